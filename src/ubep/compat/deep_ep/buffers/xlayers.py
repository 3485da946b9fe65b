"""`deep_ep.buffers.xlayers`, which an SGLang DeepEP dispatcher imports beside `Buffer`.

The module exists so that such an import succeeds: that dispatcher imports `Buffer`,
`Config` and `XLayerScheduler` in one `try`, and without this module it would turn
itself off entirely. ubep has no cross-layer scheduler, so constructing one raises
NotImplementedError; the dispatcher catches that and keeps to its plain DeepEP calls,
which ubep serves. (Upstream DeepEP 2.1 has no such module either.)
"""

from __future__ import annotations

from typing import Any


class XLayerScheduler:
    """Not provided: constructing it raises NotImplementedError (see the module doc)."""

    def __init__(self, *args: Any, **kwargs: Any):
        raise NotImplementedError(
            "XLayerScheduler (cross-layer dispatch/combine scheduling) is not provided by ubep's DeepEP "
            "layer; use the Buffer's dispatch and combine calls"
        )

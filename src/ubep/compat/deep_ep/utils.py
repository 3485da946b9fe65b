"""DeepEP's `deep_ep.utils`: `EventHandle` and `EventOverlap` over ubep's pending receive halves.

DeepEP's event is a CUDA event; the wrapper adds `extra_tensors` (tensors kept
alive until the wait, its stand-in for `record_stream`). Here the "event" is the
receive half of an asynchronous call, or nothing when the call already finished,
so waiting on it runs that half once.
"""

from __future__ import annotations

from typing import Any

import torch

from ubep.overlap import EventOverlap as _Pending


class EventHandle:
    """DeepEP's event: `EventHandle()` marks "everything issued so far", which on CPU is already done."""

    __slots__ = ("_pending",)

    def __init__(self, pending: _Pending | None = None):
        self._pending = pending

    def current_stream_wait(self) -> None:
        """Complete the work behind this event (once; later calls return at once)."""
        if self._pending is not None:
            self._pending.wait()


class EventOverlap:
    """DeepEP's `EventOverlap`: `.event` (an EventHandle, or None when the call finished synchronously)
    and `.extra_tensors`; `current_stream_wait()` or a `with` block completes the work."""

    def __init__(
        self, event: EventHandle | None = None, extra_tensors: tuple[torch.Tensor, ...] | None = None
    ):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Wait for the event; with no event (a synchronous call) there is nothing to wait for."""
        if self.event is not None:
            self.event.current_stream_wait()

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.current_stream_wait()


def pending_event(pending: _Pending, async_finish: bool, keep: tuple | None = None) -> EventOverlap:
    """What a DeepEP call returns as its event: an EventHandle over the pending half when
    `async_finish`, else an empty EventOverlap (the call waited before returning)."""
    if not async_finish:
        pending.wait()
        return EventOverlap()
    return EventOverlap(EventHandle(pending), tuple(t for t in keep if t is not None) if keep else None)


def wait_previous(previous_event: EventOverlap | None) -> None:
    """DeepEP's `previous_event`: the call starts after it; run its pending half if it has one."""
    if previous_event is not None and getattr(previous_event, "event", None) is not None:
        previous_event.event.current_stream_wait()

"""The fabric floor: bytes to ranks on other hosts, as messages (`ubep.across.fabric.base`).

    protocol -> [fabric: gloo | nixl] -> the wire

`open_fabric` builds the engine a Buffer asks for (`ubep.registry.FABRICS`) and says why: "gloo"
(torch.distributed point-to-point over TCP, no new dependency, the default) or
"nixl" (NIXL one-sided writes with notifications over UCX: TCP, InfiniBand,
EFA; the `nixl` extra). No protocol imports an engine: they take a `Fabric`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

from ubep.across.fabric.base import Fabric, Lane, Message, Outgoing
from ubep.registry import FABRICS, GLOO, NIXL, one_of


def open_fabric(
    requested: str,
    group: dist.ProcessGroup | None,
    rank: int,
    num_ranks: int,
    lanes: Sequence[Lane],
    timeout_s: float,
) -> tuple[Fabric, str]:
    """(fabric, reason), collective over the group; ValueError names the choices, ImportError the
    extra a missing engine needs."""
    one_of("fabric", FABRICS, requested)
    if requested == NIXL.name:
        from ubep.across.fabric.nixl import NixlFabric  # imported here: nixl is optional

        return NixlFabric(group, rank, num_ranks, lanes, timeout_s), "requested"
    from ubep.across.fabric.gloo import GlooFabric

    reason = (
        "requested" if requested == GLOO.name else "the default: torch.distributed point-to-point, no extra"
    )
    return GlooFabric(group, rank, num_ranks, lanes, timeout_s), reason


__all__ = ["Fabric", "Lane", "Message", "Outgoing", "open_fabric"]

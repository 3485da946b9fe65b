"""The fabric floor: bytes to ranks on other hosts, as messages (`ubep.across.fabric.base`).

    protocol -> [fabric: zmq | gloo | nixl] -> the wire

`open_fabric` builds the engine a Buffer asks for (`ubep.registry.FABRICS`) and says why: "zmq"
(ZeroMQ over TCP: every wait blocks on all peers at once; the `zmq` extra), "gloo"
(torch.distributed point-to-point over TCP, no new dependency: its waits poll) or
"nixl" (NIXL one-sided writes with notifications over UCX: TCP, InfiniBand,
EFA; the `nixl` extra). "auto" picks zmq where every rank can import pyzmq, else
gloo: a rank never waits on a peer by polling where it can block.
No protocol imports an engine: they take a `Fabric`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import torch.distributed as dist

from ubep.across.fabric.base import Fabric, Lane, Message, Outgoing
from ubep.deadlines import collective_deadline, construction_s
from ubep.extras import install_hint
from ubep.registry import AUTO, FABRICS, GLOO, NIXL, ZMQ, one_of


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
    name, reason = (requested, "requested") if requested != AUTO else auto_fabric(group, num_ranks, timeout_s)
    if name == NIXL.name:
        from ubep.across.fabric.nixl import NixlFabric  # imported here: nixl is optional

        return NixlFabric(group, rank, num_ranks, lanes, timeout_s), reason
    if name == ZMQ.name:
        from ubep.across.fabric.zmq import ZmqFabric  # imported here: pyzmq is optional

        return ZmqFabric(group, rank, num_ranks, lanes, timeout_s), reason
    from ubep.across.fabric.gloo import GlooFabric

    return GlooFabric(group, rank, num_ranks, lanes, timeout_s), reason


def auto_fabric(group: dist.ProcessGroup | None, num_ranks: int, timeout_s: float) -> tuple[str, str]:
    """(engine, why) for fabric "auto", the same on every rank (collective): zmq where every rank can
    import pyzmq (its waits block on all peers at once), else gloo (no extra; its waits poll)."""
    can: list[bool | None] = [None] * num_ranks
    with collective_deadline(group, construction_s(timeout_s), "Buffer construction (fabric: auto)"):
        dist.all_gather_object(can, importlib.util.find_spec("zmq") is not None, group=group)
    if all(can):
        return ZMQ.name, "auto: pyzmq on every rank, so every wait blocks on all peers at once"
    missing = [r for r, ok in enumerate(can) if not ok]
    return GLOO.name, (
        f"auto: rank(s) {missing} lack pyzmq ({install_hint(ZMQ.extra)}), so torch.distributed "
        "point-to-point, whose waits poll"
    )


__all__ = ["Fabric", "Lane", "Message", "Outgoing", "open_fabric"]

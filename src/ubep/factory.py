"""Assembly: one transport, one protocol and one engine for a Buffer, chosen once, from tables:
a protocol on a heap (its blocks, its exchange), where the heap's memory lives, or the
collectives that stand in for a heap across hosts.

The Buffer and `ubep.compat` both build through here, so what a given set of
options constructs (and how many bytes of shared memory it maps) is decided
in one place.

Legend: see `ubep.layout`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from ubep import registry
from ubep.across.collectives.bsp_flat import BspDist
from ubep.across.collectives.bsp_hier import HierExchange
from ubep.across.collectives.ll_flat import LLDist
from ubep.across.fabric import open_fabric
from ubep.across.ll_flat import LLFabric
from ubep.across.ll_flat import lanes as ll_fabric_lanes
from ubep.across.ubep_flat import UbepFabric
from ubep.across.ubep_flat import lanes as fabric_lanes
from ubep.across.ubep_hier import HierFabric, rail_of
from ubep.across.ubep_hier import lanes as hier_lanes
from ubep.across.ubep_tiers import Racks, TierFabric
from ubep.across.ubep_tiers import lanes as tier_lanes
from ubep.engine import Engine, choose_engine
from ubep.faults import FaultPoints
from ubep.group import GroupInfo
from ubep.protocols.base import Exchange, LowLatencyExchange, Sizing
from ubep.protocols.bsp import BspBlocks, BspExchange
from ubep.protocols.ll import LLBlocks, LLExchange
from ubep.protocols.ll.local import LLLocal
from ubep.protocols.ll.plans import AFTER_DATA, IN_WORD
from ubep.protocols.local import LocalExchange
from ubep.protocols.ubep import UbepBlocks, UbepExchange
from ubep.protocols.warmup import WARM_UPS, warm_up
from ubep.schedule import DISTANCE
from ubep.transport.base import Header, Region
from ubep.transport.cuda import cuda_heap
from ubep.transport.heap import Layout
from ubep.transport.shm import Rejoining, rejoined_heap, shm_heap
from ubep.transport.virtual import virtual_heap


@dataclass(frozen=True, kw_only=True, slots=True)
class Options:
    """What a Buffer was asked for, once validated."""

    transport: str  # as chosen: a name of `ubep.registry.TRANSPORTS`
    protocol: str  # a name of `ubep.registry.PROTOCOLS`
    low_latency: bool
    timeout_s: float
    workers: int = 1
    schedule: str = DISTANCE  # a policy of `ubep.schedule`
    ll_flag: str = AFTER_DATA  # low-latency rows: "after-data" or "in-word" (the Triton halves only)
    capturable: bool = False  # Triton halves (both modes) that read nothing back on the host
    fabric: str = registry.AUTO  # how bytes reach other hosts: "auto" or a name of `ubep.registry.FABRICS`
    racks: int = 1  # racks of consecutive hosts (transport "tiers": the slow tier runs between them)


def ready_engine(
    requested: str = registry.AUTO,
    warm_ups: Sequence[str] = WARM_UPS,
    deadline: float | None = None,
    examples: bool = False,
) -> tuple[Engine, str]:
    """`choose_engine`, with the compiled call halves of `warm_ups` (`ubep.protocols.warmup`) loaded
    or compiled, so that no call compiles while its peers wait; "auto" falls back to the torch engine,
    with the reason, where a half does not compile here. Slow the first time on a host (each
    warm-up compiles once per host, `ubep.engine.compile_once`): call it before the ranks meet.
    Waiting past `deadline` (time.monotonic) for another process's compile that shows no progress
    raises CompileWaitTimeoutError. `examples`: check every kernel on its example in this process,
    not only where it compiles (`ubep warm`)."""
    halves = {name: partial(warm_up, name=name) for name in warm_ups}
    return choose_engine(requested, deadline, halves, examples)


# What each protocol declares on a heap, and how it is built over one.
HEAP_PROTOCOLS = {
    registry.UBEP.name: (
        UbepBlocks,
        lambda heap, engine, s, faults, o: UbepExchange(
            heap, engine, s, faults, workers=o.workers, policy=o.schedule, capturable=o.capturable
        ),
    ),
    registry.BSP.name: (
        BspBlocks,
        lambda heap, engine, s, faults, o: BspExchange(heap, engine, s, faults, capturable=o.capturable),
    ),
}
# Where a heap's memory lives (each transport whose spec says `heap`): a host's shared segments, a
# virtual world's arenas, or each GPU's symmetric memory (the headers of every protocol whose halves
# run as device kernels with it: those kernels stamp and poll them there).
HEAPS = {
    registry.SHM.name: lambda blocks, info, o, headers: (
        rejoined_heap(blocks, info.group, o.timeout_s)
        if isinstance(info.group, Rejoining)
        else shm_heap(blocks, info.group, info.rank, info.world_size, o.timeout_s)
    ),
    registry.VIRTUAL.name: lambda blocks, info, o, headers: virtual_heap(blocks, info.group, o.timeout_s),
    registry.CUDA.name: lambda blocks, info, o, headers: cuda_heap(
        blocks,
        info.group if info.group is not None else dist.group.WORLD,
        info.rank,
        info.world_size,
        o.timeout_s,
        torch.device("cuda", torch.cuda.current_device()),
        device_headers=headers,
    ),
}
DEVICE_HEADERS = ("ll.sent", "ll.returned")  # `LLBlocks`' headers


def ubep_over_fabric(
    info: GroupInfo, sizing: Sizing, o: Options, engine: Engine, faults: FaultPoints
) -> tuple[Exchange, LLFabric | None]:
    """UBEP across hosts on one fabric, both modes on its lanes (so a peer in a call of another kind is
    named): every peer over it (transport "dist"), or rails over it and a heap within each node
    ("hier"), or rails between racks, then between the hosts of a rack, and a heap within each host
    ("tiers"); low-latency mode reaches every peer. Collective to build."""
    spec = registry.TRANSPORTS[o.transport]
    rail = rail_of(info) if spec.hierarchical else None
    racks = Racks.of(info.node_of_rank, info.rank, o.racks) if spec.racked else None
    if racks is not None:
        normal = tier_lanes(sizing, racks)
    else:
        normal = fabric_lanes(sizing) if rail is None else hier_lanes(sizing, rail)
    lanes = normal + (ll_fabric_lanes(sizing) if o.low_latency else ())
    fabric, reason = open_fabric(o.fabric, info.group, info.rank, info.world_size, lanes, o.timeout_s)
    fabric.faults = faults  # a "cut" fault drops what this rank sends to the peers it names
    try:
        if rail is None:
            exchange: Exchange = UbepFabric(fabric, engine, sizing, reason)
        elif racks is not None:
            exchange = TierFabric(info, sizing, o.timeout_s, engine, fabric, reason, racks)
        else:
            exchange = HierFabric(info, sizing, o.timeout_s, engine, fabric, reason)
    except BaseException:
        fabric.close()
        raise
    return exchange, LLFabric(fabric, engine, sizing) if o.low_latency else None


# Where memory is not addressable (across hosts): the normal-mode exchange of each transport and
# protocol that does not go over a fabric (`ProtocolSpec.over_fabric`): bsp keeps the torch.distributed
# collectives, the bulk-synchronous baseline.
ACROSS_HOSTS = {
    (registry.DIST.name, registry.BSP.name): lambda info, s, o, engine, faults: BspDist(
        info.group, info.rank, s, o.timeout_s, faults
    ),
    (registry.HIER.name, registry.BSP.name): lambda info, s, o, engine, faults: HierExchange(
        info, s, o.timeout_s, engine
    ),
}


def heap_blocks(
    sizing: Sizing, protocol: str, low_latency: bool, ll_flag: str = AFTER_DATA
) -> tuple[Region | Header, ...]:
    """The memory every rank of a one-host heap holds for these options."""
    normal = HEAP_PROTOCOLS[protocol][0].of(sizing).all()
    return normal + (LLBlocks.of(sizing, in_word=ll_flag == IN_WORD).all() if low_latency else ())


def heap_layout(
    sizing: Sizing, protocol: str = registry.UBEP.name, low_latency: bool = False, ll_flag: str = AFTER_DATA
) -> Layout:
    """The layout of one rank's memory for these options: `nbytes` mapped, `touchable` by calls."""
    return Layout(sizing.num_ranks, heap_blocks(sizing, protocol, low_latency, ll_flag))


def heap_bytes(
    sizing: Sizing, protocol: str = registry.UBEP.name, low_latency: bool = False, ll_flag: str = AFTER_DATA
) -> int:
    """Bytes of shared memory one rank maps for these options (the size of its segment)."""
    return heap_layout(sizing, protocol, low_latency, ll_flag).nbytes


def build(
    info: GroupInfo, sizing: Sizing, options: Options, engine: Engine, faults: FaultPoints
) -> tuple[Exchange, LowLatencyExchange | None]:
    """(normal-mode exchange, low-latency exchange or None); collective over the group."""
    o = options
    transport = registry.TRANSPORTS[o.transport]
    if (o.capturable or (o.low_latency and o.ll_flag != AFTER_DATA)) and not transport.heap:
        raise ValueError(
            f"ll_flag={o.ll_flag!r}, capturable={o.capturable}: these need the Triton halves "
            f"on a heap (transport 'shm', 'virtual' or 'cuda'); this Buffer runs on {o.transport!r}"
        )
    if o.transport == registry.LOCAL.name:
        return LocalExchange(sizing), LLLocal(engine) if o.low_latency else None
    if transport.crosses_hosts and registry.PROTOCOLS[o.protocol].over_fabric:
        return ubep_over_fabric(info, sizing, o, engine, faults)
    if transport.crosses_hosts and (o.transport, o.protocol) not in ACROSS_HOSTS:
        raise ValueError(
            f"transport={o.transport!r} runs protocol {registry.UBEP.name!r} only, not {o.protocol!r}"
        )
    if transport.crosses_hosts:  # low-latency mode takes the collective path too
        normal = ACROSS_HOSTS[o.transport, o.protocol](info, sizing, o, engine, faults)
        return normal, LLDist(info.group, info.rank, sizing, engine, o.timeout_s) if o.low_latency else None
    normal_headers = (
        registry.PROTOCOLS[o.protocol].device_headers
        if registry.ENGINES[engine.name].device_kernels and o.workers == 1
        else ()
    )
    heap = HEAPS[o.transport](
        heap_blocks(sizing, o.protocol, o.low_latency, o.ll_flag), info, o, DEVICE_HEADERS + normal_headers
    )
    normal = HEAP_PROTOCOLS[o.protocol][1](heap, engine, sizing, faults, o)
    if not o.low_latency:
        return normal, None
    try:
        return normal, LLExchange(heap, engine, sizing, faults, o.ll_flag, o.capturable)
    except BaseException:
        normal.close()  # the heap is the normal exchange's too
        raise

"""The rows measured inside ubep's own launcher: ubep, bsp-shm, bsp-gloo and the memcpy floor;
across nodes also ubep-gloo and ubep-nixl (ubep with the gloo or nixl fabric, where the ubep row takes
the default one) and hier-bsp (the hierarchical collectives).

`measure_rank` runs on every rank: it opens every system and checks one
dispatch and one combine of each against the reference, then times whichever
system the conductor names, turn by turn (see `turns`), each call from a
common start instant (see `timing`). The row "ubep-stats" is ubep recording stats
(`--stats`): rank 0 saves the merged snapshot once the turns are over. A slow rank
(`--slow-rank`) sleeps before each call of every Buffer row, as a rank whose compute
runs late would.
"""

from __future__ import annotations

import os
import time
from contextlib import ExitStack
from typing import NamedTuple

import torch
import torch.distributed as dist

import ubep
from ubep import reference
from ubep.bench import placed
from ubep.bench.timing import LEAD_S
from ubep.bench.turns import Calls, Samples, Turns, take_turns
from ubep.bench.workload import (
    LL_ROW,
    PLACED_SYSTEMS,
    UBEP_ROW,
    BenchConfig,
    Workload,
    build,
    expected_combine,
)
from ubep.group import GroupInfo, choose_transport
from ubep.registry import AUTO, BSP, DIST, GLOO, HIER, NIXL, SHM, TIERS, UBEP


class BufferSystem(NamedTuple):
    """How a row's Buffer is built: on one node, and across nodes."""

    protocol: str
    transport: str
    across: str  # the transport across nodes; AUTO: the one a Buffer picks for the bench's layout
    fabric: str | None = None  # None: the Buffer's default ("auto": zmq where pyzmq is installed)

    def transport_for(self, cfg: BenchConfig) -> str:
        """The transport this row runs in `cfg`: across nodes, AUTO resolved as `choose_transport` does
        (dist with one rank per host, where hier would cross with the same rows and float32
        partials back; hier with several)."""
        if cfg.nodes == 1:
            return self.transport
        if self.across != AUTO:
            return self.across
        node_of_rank = tuple(r // (cfg.ranks // cfg.nodes) for r in range(cfg.ranks))
        return choose_transport(AUTO, GroupInfo(None, 0, cfg.ranks, node_of_rank))[0]


BUFFER_SYSTEMS = {
    UBEP_ROW: BufferSystem(UBEP.name, SHM.name, AUTO),  # across nodes: over the fabric, as auto picks
    "ubep-stats": BufferSystem(UBEP.name, SHM.name, AUTO),
    "ubep-gloo": BufferSystem(UBEP.name, HIER.name, AUTO, GLOO.name),
    "ubep-nixl": BufferSystem(UBEP.name, HIER.name, AUTO, NIXL.name),
    "hier-bsp": BufferSystem(BSP.name, HIER.name, HIER.name),  # rail all-to-alls: the collective path
    "ubep-tiers": BufferSystem(UBEP.name, TIERS.name, TIERS.name),  # once per rack, then per host
    "ubep-dist": BufferSystem(UBEP.name, DIST.name, DIST.name),  # every peer directly, over the fabric
    "bsp-shm": BufferSystem(BSP.name, SHM.name, SHM.name),
    "bsp-gloo": BufferSystem(BSP.name, DIST.name, DIST.name),  # the flat gloo all-to-all
}
# Low-latency mode exists as the ubep protocol on shared memory and as the collective path.
LL_SYSTEMS = {UBEP_ROW: SHM.name, "ubep-stats": SHM.name, "bsp-gloo": DIST.name, LL_ROW: SHM.name}
STATS_SYSTEM = "ubep-stats"


def common_start() -> float:
    """A start instant every rank agrees on, LEAD_S ahead of rank 0's clock."""
    dist.barrier()
    instant = torch.tensor([time.monotonic() + LEAD_S], dtype=torch.float64, device="cpu")
    dist.broadcast(instant, src=0)
    return float(instant)


def verify(name: str, got: ubep.DispatchResult, combined: torch.Tensor, work: Workload, me: int) -> None:
    want = work.expected[me]
    if not (
        torch.equal(got.recv_x, want.recv_x_MH) and torch.equal(got.recv_topk_idx, want.recv_topk_idx_MK)
    ):
        raise AssertionError(f"{name}: dispatch on rank {me} differs from the reference")
    if not torch.equal(combined, expected_combine(work, me)):
        raise AssertionError(f"{name}: combine on rank {me} differs from the reference")


def slowed(calls: Calls, cfg: BenchConfig) -> Calls:
    """`calls`, each after a sleep of cfg.delay_us on cfg.slow_rank (unchanged elsewhere)."""
    if dist.get_rank() != cfg.slow_rank:
        return calls
    delay_s = cfg.delay_us / 1e6

    def late(call):
        def run():
            time.sleep(delay_s)
            return call()

        return run

    return Calls(late(calls.dispatch), late(calls.combine))


def open_buffer(
    name: str, cfg: BenchConfig, work: Workload, tokens: int, stack: ExitStack, opened: dict
) -> Calls:
    """A normal-mode Buffer for `name`, checked once against the reference (kept in `opened`)."""
    if name in PLACED_SYSTEMS:
        return placed.open_placed(name, cfg, work, tokens, stack)
    me = dist.get_rank()
    system = BUFFER_SYSTEMS[name]
    transport = system.transport_for(cfg)
    scheduling = (
        {"workers": cfg.workers, "schedule": cfg.schedule}
        if transport == SHM.name and system.protocol == UBEP.name
        else {}
    )
    x, idx, w = work.xs[me], work.topk_idx[me], work.topk_weights[me]
    buf = stack.enter_context(
        ubep.Buffer(
            hidden=cfg.hidden,
            num_experts=cfg.experts,
            max_tokens_per_rank=max(tokens, 1),
            max_topk=cfg.topk,
            protocol=system.protocol,
            transport=transport,
            timeout_s=cfg.timeout_s,
            stats=name == STATS_SYSTEM,
            fabric=system.fabric,
            low_latency=False,  # normal-mode rows: no low-latency slots (2.2 GiB a rank at 8 x 128 tokens)
            racks=cfg.racks,
            **scheduling,
        )
    )
    opened[name] = buf
    got = buf.dispatch(x, topk_idx=idx, topk_weights=w)
    verify(name, got, buf.combine(got.recv_x, got.handle).combined_x, work, me)
    return Calls(
        lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w), lambda: buf.combine(got.recv_x, got.handle)
    )


def open_ll(
    name: str, cfg: BenchConfig, work: Workload, tokens: int, stack: ExitStack, opened: dict
) -> Calls:
    """A low-latency Buffer for `name` (dispatch and weighted combine), checked once against the reference."""
    me = dist.get_rank()
    x, idx, w = work.xs[me], work.topk_idx[me], work.topk_weights[me]
    T = max(tokens, 1)
    buf = stack.enter_context(
        ubep.Buffer(
            hidden=cfg.hidden,
            num_experts=cfg.experts,
            max_tokens_per_rank=T,
            max_topk=cfg.topk,
            transport=LL_SYSTEMS[name],
            timeout_s=cfg.timeout_s,
            stats=name == STATS_SYSTEM,
            low_latency=True,
        )
    )
    opened[name] = buf
    got = buf.low_latency_dispatch(x, idx, T, cfg.experts)
    combined = buf.low_latency_combine(got.recv_x, idx, w, got.handle).combined_x
    verify_ll(name, got, combined, work, T, me)
    return Calls(
        lambda: buf.low_latency_dispatch(x, idx, T, cfg.experts),
        lambda: buf.low_latency_combine(got.recv_x, idx, w, got.handle),
    )


def verify_ll(name: str, got, combined: torch.Tensor, work: Workload, T: int, me: int) -> None:
    """This rank's rows and combine against the reference, computed for this rank only: every rank's
    [L, R * T, H] rows on every rank took R times the memory (30 GB over 8 ranks at the bench's shape)."""
    (ref,) = reference.low_latency_dispatch(work.xs, work.topk_idx, work.num_experts, T, destinations=[me])
    if not torch.equal(got.recv_count, ref.recv_count_L):
        raise AssertionError(f"{name}: low-latency counts on rank {me} differ from the reference")
    for j, count in enumerate(ref.recv_count_L.tolist()):
        if not torch.equal(got.recv_x[j, :count], ref.recv_x_LMX[j, :count]):
            raise AssertionError(
                f"{name}: low-latency rows of expert {j} on rank {me} differ from the reference"
            )
    x, idx = work.xs[me], work.topk_idx[me]  # the experts return their rows as they came: y(t, k) = x[t]
    y_NKH = x[:, None].expand(x.shape[0], idx.shape[1], x.shape[1])
    want = reference.weighted_sum(y_NKH, work.topk_weights[me], idx >= 0).to(x.dtype)
    if not torch.equal(combined, want):
        raise AssertionError(f"{name}: low-latency combine on rank {me} differs from the reference")


def open_floor(cfg: BenchConfig, work: Workload) -> Calls:
    """Every rank copies the bytes it must write, all at once: the physical limit here."""
    me = dist.get_rank()
    row_bytes = cfg.hidden * work.xs[0].element_size()
    copies = []
    for nbytes in (work.recv_rows(cfg.mode)[me] * row_bytes, work.sent_rows(me, cfg.mode) * row_bytes):
        src = torch.ones(nbytes, dtype=torch.uint8, device="cpu")
        dst = torch.zeros(nbytes, dtype=torch.uint8, device="cpu")
        copies.append(lambda d=dst, s=src: d.copy_(s))
    return Calls(*copies)


def _open(name: str, cfg: BenchConfig, work: Workload, tokens: int, stack: ExitStack, opened: dict) -> Calls:
    """Row `name`'s calls: the floor's copies, or a Buffer in low-latency mode (--mode ll, or the
    ubep-ll row of a normal-mode run) or in normal mode, late on the slow rank (--slow-rank)."""
    if name == "memcpy-floor":
        return open_floor(cfg, work)
    opener = open_ll if cfg.mode == "ll" or name == LL_ROW else open_buffer
    return slowed(opener(name, cfg, work, tokens, stack, opened), cfg)


def measure_rank(cfg: BenchConfig, tokens: int, systems: tuple[str, ...], turns_dir: str) -> Samples:
    """Open and verify every requested system, then time the one named at each turn, until QUIT.

    Returns this rank's (starts, finishes) per system and operation, one entry per turn.
    """
    if "ubep-nixl" in systems:  # values the user set are kept
        os.environ.setdefault("UCX_TLS", "tcp")  # as between hosts: no shared-memory shortcut
        os.environ.setdefault("UCX_MODULES", "^efa")  # else NIXL 1.5.1 crashes at exit (docs/multinode.md)
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # two INFO lines per agent otherwise
    work = build(cfg, tokens)
    turns = Turns(turns_dir, dist.get_rank(), cfg.timeout_s * 4)
    opened: dict[str, ubep.Buffer] = {}
    with ExitStack() as stack:
        stack.callback(turns.close)
        calls = {}
        for name in systems:
            calls[name] = _open(name, cfg, work, tokens, stack, opened)
            if dist.get_rank() == 0:  # the bench says which rows are ready as they come
                turns.opened(name)
        samples = take_turns(turns, calls, common_start)
        if STATS_SYSTEM in opened:  # every rank merges; rank 0 keeps the file
            merged = opened[STATS_SYSTEM].stats(merge=True)
            if dist.get_rank() == 0:
                merged.save(cfg.stats_path)
        return samples

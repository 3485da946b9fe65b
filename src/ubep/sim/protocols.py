"""The protocols' message patterns, timed on the fabric model (`engine`).

Every phase returns, per rank, when that rank holds its result (PhaseTime).
Synchronization is made of messages too: a barrier is an all-to-all of flag
writes (each rank's spread over its workers), each a real message through the
same stages, plus one `poll_us` after the last flag lands.

  ubep       dispatch: count role (W // 16 workers, at least one) writes a routing
             header to every rank; token workers write the scheduler's pieces,
             flag fused into the data (TFF: 480 B payload per 512 B); receivers
             compute offsets when a header lands (`prefix_us`) and reorder each
             source's block as soon as both it and its offsets are there. No barrier.
             combine: pieces of the transposed counts pushed home, TFF; the home
             reduces slot by slot in ascending rank order.
  bsp        dispatch: count all-to-all, barrier, equal token ranges per worker
             (BSP_SEND_POLICY), each piece's payload then its flag after a stop-and-wait
             ack, barrier, flag
             verification (R polls) and prefix sums, barrier, reorder.
             combine: barrier, push with flags, barrier, reduce.
  deepep-ll  one message per (token, expert), no dedup; after a worker has issued
             all of its tokens for an expert it writes that expert's count; the
             receiver waits for every count, then unpacks. Combine mirrors it.

Legend: R ranks, N tokens per rank, K top-k, E experts, Z messages. Times in us.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from ubep import schedule
from ubep.costmodel import CostParams, copy_us
from ubep.layout import ExpertPlacement, token_in_rank
from ubep.sim import engine
from ubep.sim import sync as sync_plans
from ubep.sim.engine import Messages, pair_max
from ubep.topology import Topology

# The baseline library's send split: the send list cut into equal token ranges per core, in
# destination order (as DeepEP's normal-mode channels take contiguous token ranges): balanced
# but distance-agnostic. The scheduling ablation's "bsp" row (whole destinations per worker)
# is a scheduler policy under the ubep protocol; see docs/simulation.md for why they differ.
BSP_SEND_POLICY = "balanced"
LL_META_BYTES = 16  # DeepEP low-latency: source index and layout info per message


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """Every rank's routing and the bytes of one row in each direction."""

    topk_RNK: np.ndarray  # int64 [R, N, K], -1 = no expert
    owner_E: np.ndarray  # int64 [E]: the rank that holds each expert
    dispatch_row_bytes: int
    combine_row_bytes: int

    @property
    def num_ranks(self) -> int:
        return self.topk_RNK.shape[0]

    @property
    def tokens(self) -> int:
        return self.topk_RNK.shape[1]

    def counts_RR(self) -> np.ndarray:
        """int64 [R, R]: tokens rank s sends to rank d (once per destination rank)."""
        R, N, K = self.topk_RNK.shape
        placement = ExpertPlacement.from_ranks(torch.from_numpy(self.owner_E), R)
        hit_XR = token_in_rank(torch.from_numpy(self.topk_RNK).reshape(R * N, K), placement)
        return hit_XR.reshape(R, N, R).sum(dim=1).numpy().astype(np.int64)


@dataclass(frozen=True, kw_only=True, slots=True)
class PhaseTime:
    """One dispatch or combine: when each rank is done, and the slowest sender worker."""

    done_R: np.ndarray  # float [R], us
    worker_us: float  # slowest token worker: its last byte out of the port, from its start
    straggler: tuple[int, int] = (-1, -1)  # that worker: (rank, worker); -1 where not tracked
    straggler_far: float = 0.0  # share of its bytes bound for the farthest class it reaches

    @property
    def latency_us(self) -> float:
        return float(self.done_R.max())


def phase(done_R: np.ndarray, data: Messages, injected_Z: np.ndarray, topo: Topology) -> PhaseTime:
    """PhaseTime with the slowest worker of `data` (last byte out of its port, from its start)."""
    if data.size == 0:
        return PhaseTime(done_R=done_R, worker_us=0.0)
    took_Z = injected_Z - data.ready_Z
    i = int(np.argmax(took_Z))
    mine = (data.src_Z == data.src_Z[i]) & (data.worker_Z == data.worker_Z[i])
    cls = topo.distance_class(data.src_Z[mine], data.dst_Z[mine])
    far = float(data.bytes_Z[mine][cls == cls.max()].sum() / max(data.bytes_Z[mine].sum(), 1))
    return PhaseTime(done_R=done_R, worker_us=float(took_Z[i]),
                     straggler=(int(data.src_Z[i]), int(data.worker_Z[i])), straggler_far=far)  # fmt: skip


def msgs(src, dst, worker, seq, nbytes, ready, hold=None) -> Messages:
    src = np.asarray(src, dtype=np.int64)
    shape = src.shape
    return Messages(
        src_Z=src,
        dst_Z=np.asarray(dst, dtype=np.int64),
        worker_Z=np.broadcast_to(worker, shape).astype(np.int64),
        seq_Z=np.broadcast_to(seq, shape).astype(float),
        bytes_Z=np.broadcast_to(nbytes, shape).astype(np.int64),
        ready_Z=np.broadcast_to(ready, shape).astype(float),
        hold_us_Z=None if hold is None else np.broadcast_to(hold, shape).astype(float),
    )


def pieces(sched: schedule.Schedule, ready_R: np.ndarray, worker_offset: int) -> Messages:
    """The scheduler's pieces as messages, each worker's in plan order."""
    plans = sched.ranks
    src = np.concatenate([np.full(rp.dest_I.size, rp.rank) for rp in plans])
    seq = np.concatenate([np.arange(rp.dest_I.size) for rp in plans])
    return msgs(
        src,
        np.concatenate([rp.dest_I for rp in plans]),
        np.concatenate([rp.worker_I for rp in plans]) + worker_offset,
        seq,
        np.concatenate([rp.bytes_I for rp in plans]),
        ready_R[src],
    )


def rank_max(idx: np.ndarray, t: np.ndarray, R: int, floor: np.ndarray | float = 0.0) -> np.ndarray:
    out = np.broadcast_to(np.asarray(floor, dtype=float), (R,)).copy()
    np.maximum.at(out, idx, t)
    return out


def barrier(enter_R: np.ndarray, topo: Topology, params: CostParams, workers: int) -> np.ndarray:
    """When each rank leaves an all-to-all flag barrier entered at `enter_R`.

    Every rank writes one flag to every other rank (in rotation order, dealt over its
    workers) and leaves once all R - 1 flags to it have landed; its workers poll them
    in parallel, so one poll follows the last.
    """
    R = enter_R.size
    if R == 1:
        return enter_R.astype(float) + params.poll_us
    src, rot = np.divmod(np.arange(R * (R - 1)), R - 1)
    dst = (src + 1 + rot) % R
    flags = msgs(src, dst, rot % workers, rot // workers, params.flag_bytes, enter_R[src])
    t = engine.simulate(flags, topo, params, workers)
    return rank_max(dst, t.arrived_Z, R, enter_R) + params.poll_us


def reorder(ready_RR: np.ndarray, rows_RR: np.ndarray, row_bytes: int, topo: Topology, by_rank: bool):
    """float [R]: each receiver copies source blocks in arrival (or rank) order once ready."""
    R = ready_RR.shape[0]
    src, dst = np.meshgrid(np.arange(R), np.arange(R), indexing="ij")
    order = src if by_rank else ready_RR
    ready, svc = ready_RR.ravel(), copy_us(topo, rows_RR.ravel() * row_bytes)
    _, end = engine.fifo(dst.ravel(), order.ravel(), ready, ready, svc)
    return rank_max(dst.ravel(), end, R)


def count_workers(workers: int) -> int:
    return max(1, workers // 16) if workers > 1 else 0


def ubep_dispatch(
    wl: Workload,
    topo: Topology,
    params: CostParams,
    workers: int,
    policy: str = schedule.DISTANCE,
    sync: str = "tff",
) -> PhaseTime:
    R, counts = wl.num_ranks, wl.counts_RR()
    cw = count_workers(workers)
    sched = schedule.plan(
        counts, topo, workers=workers - cw, row_bytes=wl.dispatch_row_bytes, policy=policy, params=params
    )
    data = pieces(sched, np.zeros(R), worker_offset=cw)
    src, rot = np.divmod(np.arange(R * R), R)
    dst = (src + 1 + rot) % R  # headers in rotation order, dealt over the count workers
    hdr = msgs(src, dst, rot % max(cw, 1), rot, params.flag_bytes + 8 * counts[src, dst], 0.0)
    d = sync_plans.deliver(
        sync,
        data,
        hdr,
        topo,
        params,
        workers,
        num_ranks=R,
        row_bytes=wl.dispatch_row_bytes,
        capacity_rows=R * wl.tokens,
    )
    hdr_arr = pair_max(src, dst, d.extra.arrived_Z, R)
    ready_RR = np.maximum(d.usable_RR, hdr_arr + params.prefix_us)
    done = reorder(ready_RR, counts, wl.dispatch_row_bytes * d.reorder_factor, topo, by_rank=False)
    return phase(done, data, d.data.injected_Z, topo)


def ubep_combine(
    wl: Workload,
    topo: Topology,
    params: CostParams,
    workers: int,
    policy: str = schedule.DISTANCE,
    sync: str = "tff",
) -> PhaseTime:
    R, back = wl.num_ranks, wl.counts_RR().T
    sched = schedule.plan(
        back, topo, workers=workers, row_bytes=wl.combine_row_bytes, policy=policy, params=params
    )
    data = pieces(sched, np.zeros(R), worker_offset=0)
    none = msgs(np.zeros(0), np.zeros(0), 0, 0, 0, 0.0)
    d = sync_plans.deliver(
        sync,
        data,
        none,
        topo,
        params,
        workers,
        num_ranks=R,
        row_bytes=wl.combine_row_bytes,
        capacity_rows=R * wl.tokens,
    )
    done = reorder(d.usable_RR, back, wl.combine_row_bytes * d.reorder_factor, topo, by_rank=True)
    return phase(done, data, d.data.injected_Z, topo)


def _bsp_send(counts: np.ndarray, ready_R, row_bytes: int, topo: Topology, params: CostParams, workers: int,
              policy: str):  # fmt: skip
    """Each piece: payload, stop-and-wait ack, then its flag. -> (send end [R], payload, its injection)"""
    R = counts.shape[0]
    sched = schedule.plan(counts, topo, workers=workers, row_bytes=row_bytes, policy=policy, params=params)
    data = pieces(sched, ready_R, worker_offset=0)
    ack_us = 2 * topo.latency_C()[topo.distance_class(data.src_Z, data.dst_Z)]
    payload = replace(data, seq_Z=2 * data.seq_Z, hold_us_Z=ack_us)
    flags = msgs(data.src_Z, data.dst_Z, data.worker_Z, 2 * data.seq_Z + 1, params.flag_bytes, data.ready_Z)
    t = engine.simulate(engine.concat([payload, flags]), topo, params, workers)
    n = data.size
    lat_back = topo.latency_C()[t.cls_Z[n:]]
    end_R = rank_max(flags.src_Z, t.arrived_Z[n:] + lat_back, R, ready_R)  # flags acknowledged
    return end_R, data, t.injected_Z[:n]


def bsp_dispatch(
    wl: Workload, topo: Topology, params: CostParams, workers: int, policy: str = BSP_SEND_POLICY
) -> PhaseTime:
    R, counts = wl.num_ranks, wl.counts_RR()
    src, rot = np.divmod(np.arange(R * (R - 1)), R - 1)
    dst = (src + 1 + rot) % R
    cnt = msgs(src, dst, rot % workers, rot, max(params.flag_bytes, 4 * R), 0.0)
    t = engine.simulate(cnt, topo, params, workers)
    counted = rank_max(src, t.arrived_Z + topo.latency_C()[t.cls_Z], R)
    b1 = barrier(counted, topo, params, workers)
    sent, data, injected = _bsp_send(counts, b1, wl.dispatch_row_bytes, topo, params, workers, policy)
    b2 = barrier(sent, topo, params, workers)
    verified = b2 + R * params.poll_us + params.prefix_us  # verify flags, prefix sums
    b3 = barrier(verified, topo, params, workers)
    done = b3 + copy_us(topo, counts.sum(axis=0) * wl.dispatch_row_bytes)
    return phase(done, data, injected, topo)


def bsp_combine(
    wl: Workload, topo: Topology, params: CostParams, workers: int, policy: str = BSP_SEND_POLICY
) -> PhaseTime:
    R, back = wl.num_ranks, wl.counts_RR().T
    b0 = barrier(np.zeros(R), topo, params, workers)
    sent, data, injected = _bsp_send(back, b0, wl.combine_row_bytes, topo, params, workers, policy)
    b1 = barrier(sent, topo, params, workers)
    done = b1 + copy_us(topo, back.sum(axis=0) * wl.combine_row_bytes)
    return phase(done, data, injected, topo)


def deepep_ll(wl: Workload, topo: Topology, params: CostParams, workers: int, combine: bool) -> PhaseTime:
    """DeepEP's low-latency dispatch (or combine): one message per (token, expert), count signals."""
    R, N, K = wl.topk_RNK.shape
    E = wl.owner_E.size
    s, n, k = np.nonzero(wl.topk_RNK >= 0)
    e = wl.topk_RNK[s, n, k]
    home, expert_rank = s, wl.owner_E[e]
    src, dst = (expert_rank, home) if combine else (home, expert_rank)
    row = wl.combine_row_bytes if combine else wl.dispatch_row_bytes + LL_META_BYTES
    worker = (n + s) % workers if combine else n % workers
    data = msgs(src, dst, worker, n * K + k, row, 0.0)
    last_issue = np.zeros(R * E)  # [home rank * E + expert]: all of that pair's data issued
    np.maximum.at(last_issue, home * E + e, engine.simulate(data, topo, params, workers).issued_Z)
    # One count per (home rank, expert): to each expert's owner (dispatch), or back home (combine).
    sig_home, sig_e = np.divmod(np.arange(R * E), E)
    sig_src, sig_dst = (wl.owner_E[sig_e], sig_home) if combine else (sig_home, wl.owner_E[sig_e])
    ready = last_issue
    sig = msgs(sig_src, sig_dst, (sig_home + sig_e) % workers, N * K + sig_e, params.flag_bytes, ready)
    t = engine.simulate(engine.concat([data, sig]), topo, params, workers)
    counted = rank_max(sig_dst, t.arrived_Z[data.size :], R)
    rows_R = np.bincount(dst, minlength=R)
    done = counted + params.poll_us + copy_us(topo, rows_R * row)
    return PhaseTime(done_R=done, worker_us=float(t.injected_Z[: data.size].max(initial=0.0)))

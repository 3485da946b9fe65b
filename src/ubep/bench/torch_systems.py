"""The rows measured inside ubep's own launcher: ubep, bsp-shm, bsp-gloo and the memcpy floor.

`measure_rank` runs on every rank: for each system it checks one dispatch and
one combine against the reference, warms up, then times `iters` iterations
of each from a common start instant (see `timing`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import ubep
from ubep import reference
from ubep.bench.timing import LEAD_S, timed
from ubep.bench.workload import BenchConfig, Workload, build, expected_combine

BUFFER_SYSTEMS = {"ubep": ("ubep", "shm"), "bsp-shm": ("bsp", "shm"), "bsp-gloo": ("bsp", "dist")}
# Low-latency mode exists as the ubep protocol on shared memory and as the collective path.
LL_SYSTEMS = {"ubep": "shm", "bsp-gloo": "dist"}


def common_start() -> float:
    """A start instant every rank agrees on, LEAD_S ahead of rank 0's clock."""
    dist.barrier()
    instant = torch.tensor([time.monotonic() + LEAD_S], dtype=torch.float64)
    dist.broadcast(instant, src=0)
    return float(instant)


def time_op(op: Callable[[], object], iters: int, warmup: int) -> tuple[list[float], list[float]]:
    """(start instants, this rank's finish times) over `iters` timed runs of `op`."""
    for _ in range(warmup):
        timed(op, common_start())
    starts, finishes = [], []
    for _ in range(iters):
        starts.append(common_start())
        finishes.append(timed(op, starts[-1]))
    return starts, finishes


def verify(name: str, got: ubep.DispatchResult, combined: torch.Tensor, work: Workload, me: int) -> None:
    want = work.expected[me]
    if not (
        torch.equal(got.recv_x, want.recv_x_MH) and torch.equal(got.recv_topk_idx, want.recv_topk_idx_MK)
    ):
        raise AssertionError(f"{name}: dispatch on rank {me} differs from the reference")
    if not torch.equal(combined, expected_combine(work, me)):
        raise AssertionError(f"{name}: combine on rank {me} differs from the reference")


def measure_buffer(name: str, cfg: BenchConfig, work: Workload, tokens: int) -> dict:
    me = dist.get_rank()
    protocol, transport = BUFFER_SYSTEMS[name]
    if cfg.nodes > 1 and name == "ubep":
        transport = "hier"  # across emulated nodes: shared memory inside, one crossing per token and node
    scheduling = (
        {"workers": cfg.workers, "schedule": cfg.schedule} if transport == "shm" and name == "ubep" else {}
    )
    x, idx, w = work.xs[me], work.topk_idx[me], work.topk_weights[me]
    with ubep.Buffer(
        hidden=cfg.hidden,
        num_experts=cfg.experts,
        max_tokens_per_rank=max(tokens, 1),
        max_topk=cfg.topk,
        protocol=protocol,
        transport=transport,
        timeout_s=cfg.timeout_s,
        **scheduling,
    ) as buf:
        got = buf.dispatch(x, topk_idx=idx, topk_weights=w)
        verify(name, got, buf.combine(got.recv_x, got.handle).combined_x, work, me)
        dispatch = time_op(lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w), cfg.iters, cfg.warmup)
        combine = time_op(lambda: buf.combine(got.recv_x, got.handle), cfg.iters, cfg.warmup)
    return {"dispatch": dispatch, "combine": combine}


def measure_ll(name: str, cfg: BenchConfig, work: Workload, tokens: int) -> dict:
    """Low-latency dispatch and (weighted) combine, checked against the reference, then timed."""
    me = dist.get_rank()
    x, idx, w = work.xs[me], work.topk_idx[me], work.topk_weights[me]
    T = max(tokens, 1)
    with ubep.Buffer(
        hidden=cfg.hidden,
        num_experts=cfg.experts,
        max_tokens_per_rank=T,
        max_topk=cfg.topk,
        transport=LL_SYSTEMS[name],
        timeout_s=cfg.timeout_s,
    ) as buf:
        got = buf.low_latency_dispatch(x, idx, T, cfg.experts)
        combined = buf.low_latency_combine(got.recv_x, idx, w, got.handle).combined_x
        verify_ll(name, got, combined, work, T, me)
        dispatch = time_op(lambda: buf.low_latency_dispatch(x, idx, T, cfg.experts), cfg.iters, cfg.warmup)
        combine = time_op(
            lambda: buf.low_latency_combine(got.recv_x, idx, w, got.handle), cfg.iters, cfg.warmup
        )
    return {"dispatch": dispatch, "combine": combine}


def verify_ll(name: str, got, combined: torch.Tensor, work: Workload, T: int, me: int) -> None:
    ref = reference.low_latency_dispatch(work.xs, work.topk_idx, work.num_experts, T)
    if not torch.equal(got.recv_count, ref[me].recv_count_L):
        raise AssertionError(f"{name}: low-latency counts on rank {me} differ from the reference")
    for j, count in enumerate(ref[me].recv_count_L.tolist()):
        if not torch.equal(got.recv_x[j, :count], ref[me].recv_x_LMX[j, :count]):
            raise AssertionError(
                f"{name}: low-latency rows of expert {j} on rank {me} differ from the reference"
            )
    ys = [r.recv_x_LMX for r in ref]
    want = reference.low_latency_combine(ys, ref, work.topk_idx, work.topk_weights)[me]
    if not torch.equal(combined, want):
        raise AssertionError(f"{name}: low-latency combine on rank {me} differs from the reference")


def measure_floor(cfg: BenchConfig, work: Workload) -> dict:
    """Every rank copies the bytes it must write, all at once: the physical limit here."""
    me = dist.get_rank()
    row_bytes = cfg.hidden * work.xs[0].element_size()
    recv_bytes = work.recv_rows(cfg.mode)[me] * row_bytes
    send_bytes = work.sent_rows(me, cfg.mode) * row_bytes
    result = {}
    for op, nbytes in (("dispatch", recv_bytes), ("combine", send_bytes)):
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        result[op] = time_op(lambda d=dst, s=src: d.copy_(s), cfg.iters, cfg.warmup)
    return result


def measure_rank(cfg: BenchConfig, tokens: int, systems: tuple[str, ...]) -> dict:
    """Every requested system's (starts, finishes) for dispatch and combine, on this rank."""
    work = build(cfg, tokens)
    measure = measure_ll if cfg.mode == "ll" else measure_buffer
    out = {}
    for name in systems:
        out[name] = measure_floor(cfg, work) if name == "memcpy-floor" else measure(name, cfg, work, tokens)
    return out

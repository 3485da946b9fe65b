"""Helpers for fault tests: run checked dispatch/combine iterations on every rank
and report how each rank ended, with the time its failing iteration took and
any shared segment of the group still in /dev/shm."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from scenarios import Scenario, expert_output

import ubep
from ubep import reference
from ubep.transport.segments import SHM_DIR, segment_pid


@dataclass(frozen=True)
class Report:
    """How one rank ended: `error` is the exception's type name (None: all iterations passed)."""

    rank: int
    error: str | None = None
    message: str = ""
    elapsed_s: float = 0.0  # time from the start of the failing iteration to the error
    completed: int = 0  # iterations that matched the reference
    residue: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)


def group_pids() -> set[int]:
    pids: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    return set(pids)


def residue(pids: set[int]) -> list[str]:
    """Segments in /dev/shm created by any of `pids`."""
    return [n for n in os.listdir(SHM_DIR) if segment_pid(n) in pids]


def scenario(seed: int = 3) -> Scenario:
    R = dist.get_world_size()
    return Scenario(name="fault", num_ranks=R, num_experts=4 * R, tokens=(16,) * R, seed=seed)


def make_buffer(sc: Scenario, protocol: str, transport: str, timeout_s: float, **kw) -> ubep.Buffer:
    return ubep.Buffer(
        hidden=sc.hidden,
        num_experts=sc.num_experts,
        max_tokens_per_rank=sc.capacity,
        protocol=protocol,
        transport=transport,
        timeout_s=timeout_s,
        **kw,
    )


def iteration(buf: ubep.Buffer, sc: Scenario, me: int, bad: str | None = None) -> None:
    """One dispatch + combine checked against the reference; `bad` spoils this rank's input
    ("dispatch": an expert id out of range; "combine": x with the wrong hidden size)."""
    xs, idxs, ws, ref = sc.expected()
    idx = idxs[me].clone()
    if bad == "dispatch":
        idx[0, 0] = sc.num_experts
    got = buf.dispatch(xs[me], topk_idx=idx, topk_weights=ws[me])
    assert torch.equal(got.recv_x, ref[me].recv_x_MH)
    y = expert_output(got.recv_x, me)
    if bad == "combine":
        y = torch.zeros(y.shape[0], sc.hidden + 1, dtype=y.dtype)
    out = buf.combine(y, got.handle)
    ys = [expert_output(ref[r].recv_x_MH, r) for r in range(sc.num_ranks)]
    want = reference.combine(ys, ref, [x.shape[0] for x in xs])[me]
    assert torch.equal(out.combined_x, want)


def run_until_failure(buf: ubep.Buffer, sc: Scenario, me: int, iterations: int) -> Report:
    """Run checked iterations until one raises a ubep error; report it."""
    completed, start = 0, time.monotonic()
    try:
        for _ in range(iterations):
            start = time.monotonic()
            iteration(buf, sc, me)
            completed += 1
    except ubep.UbepError as error:
        return Report(me, type(error).__name__, str(error), time.monotonic() - start, completed)
    return Report(me, completed=completed)

"""Overlap: the send half returns at once and the receive half runs later, for real.

Rank 0 sleeps 1 s between its send half and its hook. The other ranks must
finish their whole dispatch meanwhile (their send half does not wait for rank
0's compute, and rank 0's rows already landed), and rank 0's hook must then
return at once. A control run where rank 0 sleeps *before* sending shows the
measurement can see a delay when there is one.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import ubep
from ubep import reference, routing

SLEEP_S = 1.0
PROMPT_S = 0.5
H, T, K = 128, 8, 2


def inputs(R: int, E: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    idxs = [routing.uniform(T, E, K, gen) for _ in range(R)]
    xs = [torch.randn(T, H, generator=gen).bfloat16() for _ in range(R)]
    return xs, idxs


def timed_round(buf: ubep.Buffer, me: int, R: int, E: int, mode: str, seed: int) -> dict[str, float]:
    """One dispatch with rank 0 sleeping (between the halves, or before sending); times in seconds."""
    xs, idxs = inputs(R, E, seed)
    dist.barrier()
    t0 = time.perf_counter()
    if me == 0 and mode == "sleep-before-send":
        time.sleep(SLEEP_S)
    got = buf.low_latency_dispatch(
        xs[me], idxs[me], T, E, async_finish=mode == "async", return_recv_hook=mode == "hook"
    )
    t_send = time.perf_counter() - t0
    if me == 0 and mode in ("hook", "async"):
        time.sleep(SLEEP_S)  # "expert compute" overlapping the peers' progress
    t_before = time.perf_counter()
    got.hook() if mode == "hook" else got.event.wait()
    t_end = time.perf_counter()
    want = reference.low_latency_dispatch(xs, idxs, E, T)[me]
    assert torch.equal(got.recv_count, want.recv_count_L)
    for j in range(E // R):
        c = int(want.recv_count_L[j])
        assert torch.equal(got.recv_x[j, :c], want.recv_x_LMX[j, :c])
    return {"send": t_send, "receive": t_end - t_before, "total": t_end - t0}


def overlap_run(transport: str) -> list[dict[str, float]]:
    me, R = dist.get_rank(), dist.get_world_size()
    E = 2 * R
    with ubep.Buffer(
        hidden=H, num_experts=E, max_tokens_per_rank=T, transport=transport, timeout_s=20
    ) as buf:
        timed_round(buf, me, R, E, "sync", seed=0)  # warm up
        return [timed_round(buf, me, R, E, mode, seed=i) for i, mode in enumerate(MODES, 1)]


MODES = ("hook", "async", "sleep-before-send")


@pytest.mark.parametrize("transport", ["shm", "dist"])
def test_work_between_the_halves_overlaps_with_peers(transport):
    per_rank = ubep.LocalLaunch(world_size=2, timeout_s=60).run(overlap_run, transport)
    for i, mode in enumerate(MODES):
        peer, sleeper = per_rank[1][i], per_rank[0][i]
        if mode == "sleep-before-send":  # control: the peer does wait when rank 0 has not sent
            assert peer["total"] > SLEEP_S * 0.8, (mode, peer)
            continue
        assert peer["send"] < PROMPT_S, (mode, peer)  # the send half never waits for rank 0's compute
        assert peer["total"] < PROMPT_S, (mode, peer)  # rank 0's rows landed before it slept
        assert sleeper["receive"] < PROMPT_S, (mode, sleeper)  # its hook found everything there

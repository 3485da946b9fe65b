"""Overlap: the send half returns at once and the receive half runs later, for real.

Rank 0 sleeps 2 s between its send half and its hook. The other ranks must
finish their whole dispatch meanwhile (their send half does not wait for rank
0's compute, and rank 0's rows already landed), and rank 0's hook must then
return at once. The checks are on the order of events (every process reads the one monotonic
clock of the host), so a loaded machine cannot fail them: a peer's dispatch ends before rank 0
wakes. A control run where rank 0 sleeps *before* sending shows the measurement can see a delay
when there is one.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import ubep
from ubep import reference, routing

SLEEP_S = 2.0  # long beside a dispatch of 8 tokens even on a loaded machine
H, T, K = 128, 8, 2


def inputs(R: int, E: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    idxs = [routing.uniform(T, E, K, gen) for _ in range(R)]
    xs = [torch.randn(T, H, generator=gen).bfloat16() for _ in range(R)]
    return xs, idxs


def timed_round(buf: ubep.Buffer, me: int, R: int, E: int, mode: str, seed: int) -> dict[str, float]:
    """One dispatch with rank 0 sleeping (between the halves, or before sending): the host's
    monotonic clock (seconds) at its start, when the send half returned, when rank 0 woke (its
    receive half's start) and at its end."""
    xs, idxs = inputs(R, E, seed)
    dist.barrier()
    t0 = time.monotonic()
    if me == 0 and mode == "sleep-before-send":
        time.sleep(SLEEP_S)
    got = buf.low_latency_dispatch(
        xs[me], idxs[me], T, E, async_finish=mode == "async", return_recv_hook=mode == "hook"
    )
    t_sent = time.monotonic()
    if me == 0 and mode in ("hook", "async"):
        time.sleep(SLEEP_S)  # "expert compute" overlapping the peers' progress
    t_woke = time.monotonic()
    got.hook() if mode == "hook" else got.event.wait()
    t_end = time.monotonic()
    want = reference.low_latency_dispatch(xs, idxs, E, T)[me]
    assert torch.equal(got.recv_count, want.recv_count_L)
    for j in range(E // R):
        c = int(want.recv_count_L[j])
        assert torch.equal(got.recv_x[j, :c], want.recv_x_LMX[j, :c])
    return {"start": t0, "sent": t_sent, "woke": t_woke, "end": t_end}


def overlap_run(transport: str) -> list[dict[str, float]]:
    me, R = dist.get_rank(), dist.get_world_size()
    E = 2 * R
    with ubep.Buffer(
        hidden=H, num_experts=E, max_tokens_per_rank=T, transport=transport, timeout_s=20, low_latency=True
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
            assert peer["end"] - peer["start"] > SLEEP_S * 0.8, (mode, peer)
            continue
        # the peer's send half did not wait for rank 0's compute, and rank 0's rows landed before
        # it slept: the peer's whole dispatch ended while rank 0 slept
        assert peer["end"] < sleeper["woke"], (mode, peer, sleeper)
        # rank 0's receive half found every row there: it did not wait as long as it had slept
        assert sleeper["end"] - sleeper["woke"] < SLEEP_S, (mode, sleeper)

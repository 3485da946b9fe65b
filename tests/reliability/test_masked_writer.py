"""After a mask, nothing from before it may touch the ranks that stay (issue 23, items 1 and 8).

Item 1: a rank frozen (SIGSTOP) inside a low-latency combine's put, after its membership check,
is masked by the others; woken, its late put lands in a survivor's memory, yet every call of the
survivors stays exact, and it stops with MaskedOutError (`fault_soak.stop_rank` runs the episode).
UBEP_STOP_EPISODES=200 runs the stress version (the fault soak's default run has 200 too).

Item 8: a low-latency receive half (hook) issued before a mask is refused with an error
that says so, and leaves the reuse words alone: the next low-latency calls work, exact
against the reference restricted to the ranks that stay (`shrinkcase`).
"""

from __future__ import annotations

import os
import threading

import fault_soak  # scripts/ is on the path (conftest.py)
import pytest
from shrinkcase import buffer, inputs, low_latency_call
from test_low_latency import CAPACITY

from ubep.transport.virtual import VirtualRank, VirtualWorld

GONE = 2


def leftover_hook(rank: VirtualRank, engine: str, kind: str, left: threading.Barrier) -> str:
    """Rank GONE leaves after one call; the others issued a low-latency `kind` with its receive half
    deferred, mask it, then run that hook: refused; their next low-latency calls are exact."""
    me, R = rank.rank, rank.world_size
    with buffer(rank, "ubep", timeout_s=2, engine=engine) as buf:
        low_latency_call(buf, 0, set())
        xs, idxs, ws = inputs(1, R)
        if me == GONE:  # it sends its dispatch rows (a combine's hook waits on them), then leaves
            if kind == "combine":
                buf.low_latency_dispatch(xs[me], idxs[me], CAPACITY, buf.num_experts)
            left.wait()
            buf.mask_ranks([GONE])
            return "left"
        sent = buf.low_latency_dispatch(
            xs[me], idxs[me], CAPACITY, buf.num_experts, return_recv_hook=kind == "dispatch"
        )
        if kind == "combine":
            sent = buf.low_latency_combine(
                sent.recv_x.clone(), idxs[me], ws[me], sent.handle, return_recv_hook=True
            )
        left.wait()
        buf.mask_ranks([GONE])
        with pytest.raises(RuntimeError, match=r"issued before rank\(s\) \[2\] were masked"):
            sent.hook()
        for seed in range(10, 14):
            low_latency_call(buf, seed, {GONE})
        return "exact"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ["torch", "numba"])
@pytest.mark.parametrize("kind", ["dispatch", "combine"])
def test_a_receive_half_from_before_a_mask_is_refused_and_the_next_calls_work(engine, kind):
    left = threading.Barrier(3)
    got = VirtualWorld(3, timeout_s=20).run(lambda rank: leftover_hook(rank, engine, kind, left))
    assert got == ["exact", "exact", "left"]


EPISODES = int(os.environ.get("UBEP_STOP_EPISODES", "2"))


@pytest.mark.timeout(180 + 20 * EPISODES)
@pytest.mark.parametrize("engine", ["torch", "numba"])
def test_a_rank_stopped_inside_its_put_and_masked_cannot_change_the_survivors_results(engine):
    episodes = EPISODES
    cfg = fault_soak.FaultSoakConfig(world_size=3, seed=5, engine=engine)
    checked, wrong, faults, misblamed = fault_soak.run_stops(cfg, 0, episodes)
    assert wrong == [] and misblamed == [], (wrong, misblamed)
    woken = [f for f in faults if f["kind"] == "stopped inside put (this rank)"]
    assert [f["error"] for f in woken] == ["MaskedOutError"] * episodes, woken
    assert any(f["kind"] == "stop" for f in faults)  # a survivor it had not served yet waited on it
    assert checked >= episodes * 2 * 9  # per survivor: A (maybe), B and C deferred, 2 more, 1 normal

"""Faults injected through `ubep.faults.FaultPlan`: killed, slow and lying ranks, and
ranks that reject their input. Every survivor must fail with an error that names
the rank at fault, in time, and leave no shared segment behind."""

from __future__ import annotations

import dataclasses
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist
from faultcase import Report, group_pids, iteration, make_buffer, residue, run_until_failure, scenario

import ubep
from ubep.faults import FaultPlan

WORLD = 4
VICTIM = 2


def named_dead(message: str) -> set[int]:
    """Ranks a message reports dead: "rank 2 died" or "rank(s) 1, 2 died".

    A survivor that has failed and exited counts as dead to the others too."""
    found = re.findall(r"rank(?:\(s\))? ([\d, ]+) died", message)
    return {int(r) for group in found for r in group.split(",")}


def killed_case(protocol: str, transport: str, plan: FaultPlan, timeout_s: float) -> Report:
    pids, me, sc = group_pids(), dist.get_rank(), scenario()
    buf = make_buffer(sc, protocol, transport, timeout_s, faults=plan)
    try:
        report = run_until_failure(buf, sc, me, iterations=4)
    finally:
        buf.close()
    return dataclasses.replace(report, residue=residue(pids))


KILLS = [
    ("ubep", "shm", "dispatch.start", 3),  # before dispatch (calls 1-2 were a good first iteration)
    ("ubep", "shm", "dispatch.end", 3),  # between dispatch and combine
    ("ubep", "shm", "combine.mid", 4),  # mid-combine: rows sent to one peer, not the others
    ("bsp", "shm", "dispatch.start", 3),
    ("bsp", "shm", "dispatch.end", 3),
    ("bsp", "shm", "combine.mid", 4),
    ("bsp", "dist", "dispatch.end", 3),
]


@pytest.mark.parametrize("protocol,transport,point,call", KILLS)
def test_killed_rank_is_named_by_every_survivor(protocol, transport, point, call):
    timeout_s = 3.0
    plan = FaultPlan(rank=VICTIM, point=point, action="kill", call=call)
    outcomes = ubep.LocalLaunch(world_size=WORLD, timeout_s=60).outcomes(
        killed_case, protocol, transport, plan, timeout_s
    )
    victim = outcomes[VICTIM]
    assert victim.cause == "died" and victim.exit_code == -signal.SIGKILL, (victim, outcomes)
    for o in outcomes:
        if o.rank == VICTIM:
            continue
        assert o.ok, o.error
        r: Report = o.result
        assert r.completed >= 1, "the first iteration, before the fault, must succeed"
        assert r.error in ("CommTimeoutError", "PeerAbortedError"), r
        assert VICTIM in named_dead(r.message), r.message
        assert r.elapsed_s < 3 * timeout_s, r
        assert r.residue == [], r.residue


def corrupt_case(protocol: str, transport: str, values: list[int]) -> list[Report]:
    """Rank 1 publishes a false token count in its first dispatch; every rank must refuse it."""
    me, reports = dist.get_rank(), []
    for value in values:
        sc = scenario()
        plan = FaultPlan(rank=1, point="dispatch.count", action="corrupt", value=value)
        with make_buffer(sc, protocol, transport, 5.0, faults=plan) as buf:
            reports.append(run_until_failure(buf, sc, me, iterations=1))
    with make_buffer(sc, protocol, transport, 5.0) as buf:
        iteration(buf, sc, me)  # the group is still in step: a clean Buffer works
    return reports


@pytest.mark.parametrize("protocol,transport", [("ubep", "shm"), ("bsp", "shm"), ("bsp", "dist")])
def test_corrupt_count_is_rejected(protocol, transport):
    values = [24 + 1000, -7]  # beyond capacity (24), and negative
    results = ubep.LocalLaunch(world_size=3, timeout_s=60).run(corrupt_case, protocol, transport, values)
    for value, reports in zip(values, zip(*results, strict=True), strict=True):
        assert any(r.error == "PeerDataError" for r in reports), reports
        for r in reports:  # each rank refuses the count, or hears that a peer refused it
            if r.error == "PeerDataError":
                assert f"rank 1 announced {value} tokens, capacity is 24" in r.message, r.message
            else:
                assert r.error == "PeerAbortedError", r
                assert "because rank 1 published data that failed its checks" in r.message, r.message


REJECT_DEADLINE_S = 30.0  # long: the peers must be told, not time out


def reject_case(protocol: str, transport: str, kinds: list[str]) -> list[tuple[str, str, float]]:
    """Rank VICTIM passes bad input; everyone records its error, then the Buffer must still work."""
    me, sc, seen = dist.get_rank(), scenario(), []
    with make_buffer(sc, protocol, transport, timeout_s=REJECT_DEADLINE_S) as buf:
        iteration(buf, sc, me)
        for kind in kinds:
            start = time.monotonic()
            try:
                iteration(buf, sc, me, bad=kind if me == VICTIM else None)
                seen.append(("none", "", 0.0))
            except (ValueError, TypeError, ubep.UbepError) as error:
                seen.append((type(error).__name__, str(error), time.monotonic() - start))
            iteration(buf, sc, me)  # a rejected call leaves the Buffer usable
    return seen


REJECTS = [("ubep", "shm", ["dispatch", "combine"]), ("bsp", "shm", ["dispatch", "combine"])]
REJECTS += [("bsp", "dist", ["dispatch", "combine"])]


@pytest.mark.parametrize("protocol,transport,kinds", REJECTS)
def test_rejecting_rank_makes_peers_fail_fast(protocol, transport, kinds):
    results = ubep.LocalLaunch(world_size=WORLD, timeout_s=90).run(reject_case, protocol, transport, kinds)
    for rank, seen in enumerate(results):
        for kind, (error, message, elapsed) in zip(kinds, seen, strict=True):
            if rank == VICTIM:
                assert error == "ValueError", message
                assert ("topk_idx" if kind == "dispatch" else "hidden size") in message
            else:
                assert error == "PeerAbortedError", (rank, error, message)
                assert f"rank {VICTIM} aborted the call (it rejected its input" in message
                assert elapsed < REJECT_DEADLINE_S, f"rank {rank} took {elapsed:.1f} s: a deadline, not told"


def delay_case(protocol: str, short: FaultPlan, long: FaultPlan) -> list[Report]:
    """A short delay is tolerated; one past the deadline is reported, naming the slow rank."""
    me, reports = dist.get_rank(), []
    for plan, timeout_s in ((short, 5.0), (long, 1.5)):
        sc = scenario()
        with make_buffer(sc, protocol, "shm", timeout_s, faults=plan) as buf:
            reports.append(run_until_failure(buf, sc, me, iterations=3))
    return reports


@pytest.mark.parametrize("protocol", ["ubep", "bsp"])
def test_delayed_rank(protocol):
    short = FaultPlan(rank=1, point="dispatch.sent", action="delay", call=3, delay_s=0.5)
    long = FaultPlan(rank=1, point="combine.start", action="delay", call=4, delay_s=6.0)
    results = ubep.LocalLaunch(world_size=WORLD, timeout_s=90).run(delay_case, protocol, short, long)
    for rank, (tolerated, stalled) in enumerate(results):
        assert tolerated.error is None and tolerated.completed == 3, tolerated
        if rank == 1:  # it may finish its late combine (the rows were there), then fails
            assert stalled.error is not None, stalled
            continue
        assert stalled.completed == 1, stalled
        assert stalled.error in ("CommTimeoutError", "PeerAbortedError"), stalled
        assert re.search(r"rank(\(s\))? 1 (after 1.5 s|sent nothing)", stalled.message), stalled.message
        assert stalled.message.startswith("combine"), stalled.message
        assert 1.4 <= stalled.elapsed_s < 3 * 1.5, stalled


def reject_and_go_on() -> list[str]:
    """Three dispatches A, B, C: rank 1 (slow) sleeps in A after publishing its own rows, before it reads
    the others'; rank VICTIM rejects its input in B and goes straight on to C. Returns what each call
    came to on this rank: "exact", or the error."""
    me, sc = dist.get_rank(), scenario()
    xs, idxs, ws, ref = sc.expected()
    slow = FaultPlan(rank=1, point="dispatch.sent", action="delay", call=1, delay_s=1.0)
    said = []
    with make_buffer(sc, "ubep", "shm", REJECT_DEADLINE_S, faults=slow) as buf:
        for call in "ABC":
            idx = idxs[me].clone()
            if call == "B" and me == VICTIM:
                idx[0, 0] = sc.num_experts  # out of range: rejected at the boundary
            try:
                got = buf.dispatch(xs[me], topk_idx=idx, topk_weights=ws[me])
                said.append("exact" if torch.equal(got.recv_x, ref[me].recv_x_MH) else "wrong")
            except (ValueError, ubep.UbepError) as error:
                said.append(f"{type(error).__name__}: {error}")
        dist.barrier()  # no rank closes while a peer may still read its rows
    return said


def test_a_rank_that_rejects_a_call_and_goes_on_leaves_a_slow_peer_its_call_before():
    """Issue 45, item 5: rank 2 completed A, rejected B and wrote C's rows over A's half while rank 1
    still read A there: rank 1 failed A (`CommTimeoutError`), which every other rank had completed,
    and the group was out of step after it. Now a rank that abandoned a call waits, as it begins the
    next, until every peer has left the call before the abandoned one."""
    results = ubep.LocalLaunch(world_size=WORLD, timeout_s=90).run(reject_and_go_on)
    for rank, (a, b, c) in enumerate(results):
        assert (a, c) == ("exact", "exact"), (rank, a, b, c)
        if rank == VICTIM:
            assert b.startswith("ValueError: topk_idx"), b
        else:
            assert b.startswith("PeerAbortedError") and f"rank {VICTIM} aborted the call" in b, (rank, b)

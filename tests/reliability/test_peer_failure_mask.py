"""on_peer_failure="mask": a rank killed (SIGKILL) or stopped (SIGSTOP) in the middle of a call, and
every survivor finishes that call and the next ones without it. Each result is checked bit for bit
against the reference fed the membership of that call (`reference.without_ranks`), the masked
rank's outputs left out of a combine it died in, and `Buffer.left_out` against the entries the
reference dropped. A rank late but within the deadline is never masked."""

from __future__ import annotations

import importlib.util
import os
import signal
import threading
import time

import numpy
import pytest
import torch
import torch.distributed as dist
from scenarios import assert_dispatch_matches, expert_output
from shrinkcase import NUM_EXPERTS_PER_RANK, buffer, inputs, normal_call
from test_low_latency import CAPACITY, LLCase, check_dispatch

import ubep
from ubep import reference
from ubep.errors import CommTimeoutError, UbepError
from ubep.faults import FaultPlan
from ubep.transport.virtual import VirtualRank, VirtualWorld

WORLD, DEAD = 3, 1
CALLS_AFTER = 25  # dispatch + combine pairs after the fault (50 calls), then low-latency pairs
LL_CALLS_AFTER = 5


def checked_pair(buf: ubep.Buffer, seed: int) -> set[int]:
    """One dispatch and combine, each checked against the reference fed the ranks masked when it
    returned; a rank masked inside the combine has its rows left out of the sums. Returns the
    ranks masked at the end."""
    me, R = buf.rank, buf.num_ranks
    E = NUM_EXPERTS_PER_RANK * R
    xs, idxs, ws = inputs(seed, R)
    got = buf.dispatch(xs[me], topk_idx=idxs[me], topk_weights=ws[me])
    at_dispatch = set(buf.masked_ranks)
    rx, ri, rw = reference.without_ranks(xs, idxs, ws, at_dispatch, E)
    ref = reference.dispatch(rx, ri, rw, E)
    where = f"call {seed} rank {me} masked {sorted(at_dispatch)}"
    assert_dispatch_matches(got, ref[me], where)
    out = buf.combine(expert_output(got.recv_x, me), got.handle, topk_weights=got.recv_topk_weights)
    at_combine = set(buf.masked_ranks)
    ys = [expert_output(ref[r].recv_x_MH, r) for r in range(R)]
    for r in at_combine - at_dispatch:  # masked inside the combine: what it would return is left out
        ys[r] = torch.zeros_like(ys[r])
    want = reference.combine(ys, ref, [x.shape[0] for x in rx])[me]
    assert torch.equal(out.combined_x, want), where
    _, ri_now, _ = reference.without_ranks(xs, idxs, ws, at_combine, E)
    assert torch.equal(out.combined_topk_weights, torch.where(ri_now[me] >= 0, ws[me], 0.0)), where
    assert torch.equal(buf.left_out(idxs[me]), (idxs[me] >= 0) & (ri_now[me] < 0)), where
    return at_combine


def checked_ll_pair(buf: ubep.Buffer, seed: int, between=None) -> set[int]:
    """One low-latency dispatch and combine, each checked as `checked_pair` checks its calls;
    `between()`, when given, runs after the dispatch."""
    me, R = buf.rank, buf.num_ranks
    E = NUM_EXPERTS_PER_RANK * R
    xs, idxs, ws = inputs(seed, R)
    got = buf.low_latency_dispatch(xs[me], idxs[me], CAPACITY, E)
    at_dispatch = set(buf.masked_ranks)
    rx, ri, rw = reference.without_ranks(xs, idxs, ws, at_dispatch, E)
    ref = reference.low_latency_dispatch(rx, ri, E, CAPACITY)
    where = f"low-latency call {seed} rank {me} masked {sorted(at_dispatch)}"
    check_dispatch(got, ref[me], None, LLCase(name="mask"), R, where)
    ys = [expert_output(r.recv_x_LMX, rank) for rank, r in enumerate(ref)]
    if between is not None:
        between()
    out = buf.low_latency_combine(ys[me], idxs[me], ws[me], got.handle)
    at_combine = set(buf.masked_ranks)
    _, ri_now, _ = reference.without_ranks(xs, idxs, ws, at_combine, E)  # masked inside: its rows left out
    # a rank masked inside the combine: its own tokens (gone from ri_now) are its dispatch's, unused here
    homes = [ri[r] if r in at_combine - at_dispatch else ri_now[r] for r in range(R)]
    assert torch.equal(out.combined_x, reference.low_latency_combine(ys, ref, homes, rw)[me]), where
    assert torch.equal(buf.left_out(idxs[me]), (idxs[me] >= 0) & (ri_now[me] < 0)), where
    return at_combine


def fault_then_on(plan: FaultPlan, timeout_s: float, protocol: str = "ubep", transport: str = "shm") -> dict:
    """Checked pairs on every rank under on_peer_failure="mask" until `plan` kills or stops rank DEAD
    inside one, then CALLS_AFTER more pairs and LL_CALLS_AFTER low-latency pairs. Every survivor
    must finish every call; rank 0 ends a stopped rank afterwards."""
    me = dist.get_rank()
    pids: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    mask = {"faults": plan, "on_peer_failure": "mask", "transport": transport}
    with buffer(None, protocol, timeout_s=timeout_s, **mask) as buf:
        seed = 0
        while not buf.masked_ranks:
            assert seed < 10, "the fault was never met"
            dist.barrier()  # the pair before is every rank's (see two_die_at_once): the fault meets this one
            started = time.monotonic()
            checked_pair(buf, seed)
            seed += 1
        met = {"seed": seed - 1, "ranks": list(buf.masked_ranks), "seconds": time.monotonic() - started}
        for seed in range(100, 100 + CALLS_AFTER):
            checked_pair(buf, seed)
        for seed in range(200, 200 + LL_CALLS_AFTER):
            checked_ll_pair(buf, seed)
    if me == 0 and plan.action == "stop":
        os.kill(pids[DEAD], signal.SIGKILL)
    return met


def check_survivors(outcomes, cause: str) -> list[dict]:
    assert outcomes[DEAD].cause == cause, outcomes[DEAD]
    survivors = [o for o in outcomes if o.rank != DEAD]
    for o in survivors:
        assert o.ok, (o.rank, o.cause, o.error)
        assert o.result["ranks"] == [DEAD], (o.rank, o.result)
    return [o.result for o in survivors]


KILLS = [  # (protocol, transport, point, call, the pair whose calls meet the death)
    ("ubep", "shm", "dispatch.start", 7, 3),  # the 4th pair's dispatch, before it publishes: masked there
    ("ubep", "shm", "dispatch.sent", 7, 3),  # its tokens are out: every dispatch completes, the combine masks
    ("bsp", "shm", "dispatch.sent", 7, 3),  # the barrier baseline: the same, through its barriers
    ("ubep", "dist", "dispatch.start", 7, 3),  # across hosts, over the default fabric: masked in the dispatch
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("protocol,transport,point,call,pair", KILLS)
def test_a_rank_killed_mid_call_is_masked_inside_it_and_every_survivor_finishes(
    protocol, transport, point, call, pair
):
    plan = FaultPlan(rank=DEAD, point=point, action="kill", call=call)
    outcomes = ubep.LocalLaunch(world_size=WORLD, timeout_s=100).outcomes(
        fault_then_on, plan, 3.0, protocol, transport
    )
    results = check_survivors(outcomes, "died")
    assert {r["seed"] for r in results} == {pair}, results
    assert max(r["seconds"] for r in results) < 3.0, results  # a death is seen before the deadline


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "dist"])
def test_a_stopped_rank_is_masked_at_the_deadline_and_every_survivor_finishes(transport):
    plan = FaultPlan(rank=DEAD, point="dispatch.start", action="stop", call=7)
    outcomes = ubep.LocalLaunch(world_size=WORLD, timeout_s=100).outcomes(
        fault_then_on, plan, 1.5, "ubep", transport
    )
    results = check_survivors(outcomes, "died")  # rank 0 ended it afterwards
    assert {r["seed"] for r in results} == {3}, results
    assert min(r["seconds"] for r in results) >= 1.5, results  # silence: masked at the deadline


def killed_in_low_latency(timeout_s: float, transport: str) -> dict:
    """Low-latency pairs; rank DEAD kills itself before the 4th pair's dispatch, so every survivor
    meets its death inside that dispatch."""
    with buffer(None, "ubep", timeout_s=timeout_s, on_peer_failure="mask", transport=transport) as buf:
        for seed in range(3):
            checked_ll_pair(buf, seed)
        dist.barrier()  # the pair before is every rank's (see two_die_at_once)
        if buf.rank == DEAD:
            os.kill(os.getpid(), signal.SIGKILL)
        started = time.monotonic()
        checked_ll_pair(buf, 3)
        met = {"seed": 3, "ranks": list(buf.masked_ranks), "seconds": time.monotonic() - started}
        for seed in range(100, 100 + CALLS_AFTER):
            checked_ll_pair(buf, seed)
        checked_pair(buf, 200)
    return met


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "dist"])
def test_a_rank_killed_before_a_low_latency_dispatch_is_masked_inside_it(transport):
    outcomes = ubep.LocalLaunch(world_size=WORLD, timeout_s=100).outcomes(
        killed_in_low_latency, 3.0, transport
    )
    check_survivors(outcomes, "died")


def killed_before_a_low_latency_combine() -> dict:
    """Rank DEAD kills itself after the 4th low-latency pair's dispatch, which every rank finished:
    every survivor expects rows from it (`inputs(3, 3)` routes each to its experts), so all fail
    that combine alike, mask it inside, and finish the combine again from the dispatch's handle,
    its entries there dropped."""
    with buffer(None, "ubep", timeout_s=3.0, on_peer_failure="mask") as buf:
        for seed in range(3):
            checked_ll_pair(buf, seed)

        def die() -> None:
            dist.barrier()  # every rank finished the dispatch
            if buf.rank == DEAD:
                os.kill(os.getpid(), signal.SIGKILL)

        _, idxs, _ = inputs(3, WORLD)
        L = NUM_EXPERTS_PER_RANK
        routed = bool(((idxs[buf.rank] >= DEAD * L) & (idxs[buf.rank] < (DEAD + 1) * L)).any())
        met = {"ranks": sorted(checked_ll_pair(buf, 3, die)), "routed to it": routed}
        for seed in range(100, 100 + LL_CALLS_AFTER):
            checked_ll_pair(buf, seed)
        checked_pair(buf, 200)
    return met


@pytest.mark.timeout(120)
def test_a_rank_killed_before_a_low_latency_combine_is_masked_and_the_combine_finishes():
    outcomes = ubep.LocalLaunch(world_size=WORLD, timeout_s=100).outcomes(killed_before_a_low_latency_combine)
    assert outcomes[DEAD].cause == "died", outcomes[DEAD]
    for o in outcomes:
        if o.rank != DEAD:
            assert o.ok, (o.rank, o.cause, o.error)
            assert o.result == {"ranks": [DEAD], "routed to it": True}, (o.rank, o.result)


def late_within_the_deadline() -> list[int]:
    """Rank DEAD sleeps 1 s of the 2 s deadline inside the 2nd pair's dispatch (its tokens out, its
    rows not received) and before the 4th pair's combine."""
    plan = FaultPlan(rank=DEAD, point="dispatch.sent", action="delay", delay_s=1.0, call=3)
    with buffer(None, "ubep", timeout_s=2.0, faults=plan, on_peer_failure="mask") as buf:
        for seed in range(6):
            if seed == 3 and buf.rank == DEAD:
                time.sleep(1.0)
            checked_pair(buf, seed)
        return list(buf.masked_ranks)


@pytest.mark.timeout(120)
def test_a_rank_late_within_the_deadline_is_never_masked():
    """Slow is not dead: nobody masks the late rank, and every result is the full reference's."""
    assert ubep.LocalLaunch(world_size=WORLD, timeout_s=100).run(late_within_the_deadline) == [[]] * WORLD


def suspecting(
    rank: VirtualRank, suspects: dict[int, int], done: threading.Barrier, timeout_s: float = 5.0
) -> str:
    """Rank r's call fails naming rank suspects[r] as silent; the staying ranks agree on the union,
    and go on exact without it. A rank that does not call (absent from `suspects`) is a dead one."""
    with buffer(rank, "ubep", timeout_s=timeout_s, on_peer_failure="mask") as buf:
        normal_call(buf, 0, set())
        done.wait()  # every rank finished the call before any masks (a masked rank's reads must fail)
        if rank.rank not in suspects:
            return "dead"
        failed = CommTimeoutError("dispatch (tokens)", [suspects[rank.rank]], timeout_s, [])
        try:
            buf._membership.mask_failed(failed, buf._exchange, buf._ll, buf._calls, buf._calls.seq)
        except ubep.MaskedOutError:
            return "masked out"
        for seed in (1, 2):
            normal_call(buf, seed, set(buf.masked_ranks))
        return str(sorted(buf.masked_ranks))


@pytest.mark.timeout(60)
def test_the_staying_ranks_agree_on_the_union_of_what_each_detected():
    """Rank 0 saw rank 3 fail, rank 1 saw rank 2, and rank 2 (alive) saw rank 3: every staying rank
    masks both 2 and 3, and rank 2, masked by the others, learns it inside the agreement."""
    done = threading.Barrier(4)
    got = VirtualWorld(4, timeout_s=50).run(lambda rank: suspecting(rank, {0: 3, 1: 2, 2: 3}, done))
    assert got == ["[2, 3]", "[2, 3]", "masked out", "dead"], got


@pytest.mark.timeout(60)
def test_a_rank_found_dead_during_the_agreement_joins_the_union_every_staying_rank_holds():
    """Ranks 3 and 4 of 5 (a host's worth) die; ranks 0-2 each saw only rank 3 fail, and meet rank 4's
    silence inside the agreement: each adds it to the union and says so in its record, so all three
    mask exactly 3 and 4 (a rank that added it without saying so left the others waiting for a
    record that never came, until each masked every other rank: groups of one)."""
    done = threading.Barrier(5)
    got = VirtualWorld(5, timeout_s=50).run(lambda rank: suspecting(rank, {0: 3, 1: 3, 2: 3}, done, 2.0))
    assert got == ["[3, 4]", "[3, 4]", "[3, 4]", "dead", "dead"], got


def two_die_at_once(transport: str, fabric: str) -> dict:
    """Ranks 2 and 3 of 4 (a host's worth) die before the 4th pair's dispatch; ranks 0 and 1 mask both
    inside it, whichever each saw first, and go on (the union on the heap: the virtual-rank test)."""
    if fabric == "nixl":
        os.environ["UCX_TLS"] = "tcp"  # as between hosts
    on = {"on_peer_failure": "mask", "transport": transport, "fabric": fabric}
    with buffer(None, "ubep", timeout_s=3.0, **on) as buf:
        for seed in range(3):
            checked_pair(buf, seed)
        # Every rank has finished the 3rd pair before any dies: a fabric whose sends leave from an I/O
        # thread (zmq) loses a killed rank's last messages, and a survivor still waiting for them
        # would meet the death in a call the dying rank had finished (the documented raise).
        dist.barrier()
        if buf.rank >= 2:
            os.kill(os.getpid(), signal.SIGKILL)
        checked_pair(buf, 3)
        met = {"ranks": list(buf.masked_ranks)}
        for seed in range(100, 100 + CALLS_AFTER):
            checked_pair(buf, seed)
        checked_ll_pair(buf, 200)
    return met


HAS_ZMQ = importlib.util.find_spec("zmq") is not None
HAS_NIXL = any(importlib.util.find_spec(name) for name in ("nixl", "nixl_cu12", "nixl_cu13"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "transport,fabric",
    [
        ("dist", "gloo"),
        pytest.param("dist", "zmq", marks=pytest.mark.skipif(not HAS_ZMQ, reason="pyzmq is not installed")),
        pytest.param("dist", "nixl", marks=pytest.mark.skipif(not HAS_NIXL, reason="NIXL is not installed")),
    ],
)
def test_two_ranks_killed_at_once_are_both_masked_inside_the_call(transport, fabric):
    outcomes = ubep.LocalLaunch(world_size=4, timeout_s=100).outcomes(two_die_at_once, transport, fabric)
    assert [o.cause for o in outcomes[2:]] == ["died", "died"], outcomes[2:]
    for o in outcomes[:2]:
        assert o.ok, (o.rank, o.cause, o.error)
        assert o.result["ranks"] == [2, 3], (o.rank, o.result)


class StarvedDealer:
    """A rank's ZeroMQ DEALER to one peer whose messages of call `seq` its I/O thread has not taken
    yet (starved, as on a loaded host): each leaves only once this rank waits for it (its tracker's
    `wait`, as `ZmqFabric.sent` does); the other messages go as usual."""

    def __init__(self, dealer, seq: int):
        self._dealer, self._seq = dealer, seq

    def send(self, message, flags=0, copy=True, track=False):
        if int(message[8:16].view(numpy.int64)[0]) != self._seq:  # the frame's seq (after its lane)
            return self._dealer.send(message, flags, copy=copy, track=track)
        return HeldMessage(self._dealer, message, flags)

    def __getattr__(self, name: str):
        return getattr(self._dealer, name)


class HeldMessage:
    """A held message's tracker: the first wait sends it, and waits for it to leave."""

    def __init__(self, dealer, message, flags: int):
        self._send = lambda: dealer.send(message, flags, copy=False, track=True)
        self._tracker = None

    @property
    def done(self) -> bool:
        return self._tracker is not None and self._tracker.done

    def wait(self, timeout: float = -1) -> None:
        if self._tracker is None:
            self._tracker = self._send()
        self._tracker.wait(timeout)


def last_messages_still_queued() -> dict:
    """Rank DEAD finishes the 3rd pair's combine (call 6) with its rows for rank 2 still in its ZeroMQ
    queue, then dies as the 4th pair's dispatch starts (call 7). Every survivor must meet the death
    in that dispatch, mask it there and go on: not rank 2 in the combine it never got those rows
    for, while rank 0 meets it in the dispatch (they would agree on different calls, and raise)."""
    plan = FaultPlan(rank=DEAD, point="dispatch.start", action="kill", call=7)
    on = {"on_peer_failure": "mask", "transport": "dist", "fabric": "zmq", "faults": plan}
    with buffer(None, "ubep", timeout_s=3.0, low_latency=False, **on) as buf:
        if buf.rank == DEAD:
            fabric = buf._exchange.fabric
            fabric._dealers[2] = StarvedDealer(fabric._dealers[2], seq=6)
        masked = [sorted(checked_pair(buf, seed)) for seed in range(8)]
        return {"ranks": list(buf.masked_ranks), "by_pair": masked}


@pytest.mark.timeout(120)
@pytest.mark.skipif(not HAS_ZMQ, reason="pyzmq is not installed")
def test_a_rank_dying_after_a_call_with_its_last_messages_queued_is_masked_in_the_next_call():
    outcomes = ubep.LocalLaunch(world_size=WORLD, timeout_s=100).outcomes(last_messages_still_queued)
    for result in check_survivors(outcomes, "died"):
        assert result["by_pair"] == [[]] * 3 + [[DEAD]] * 5, result


def killed_between_two_puts(engine: str) -> dict:
    """Rank DEAD dies inside the 4th low-latency combine after putting its rows into one home only:
    that home (rank 2, the first it serves) completes the call, rank 0 (`inputs(3, 3)` routes it
    rows from DEAD too) fails it, and rank 2 fails its next call, the dispatch, on rank 0's abort.
    Rank 0 finishes the combine in place (the rows DEAD did not put left out) and rank 2 runs its
    dispatch again, so no survivor raises and a loop that goes on to its next pair after an error
    stays in step, knowing nothing of which ranks completed what; every pair after is exact."""
    plan = FaultPlan(rank=DEAD, point="ll_combine.put", action="kill", call=8)
    with buffer(None, "ubep", timeout_s=3.0, faults=plan, on_peer_failure="mask", engine=engine) as buf:
        raised = []
        for seed in range(10):
            try:
                checked_ll_pair(buf, seed)
            except UbepError:  # the loop of an application that goes on with its next step
                raised.append(seed)
        checked_pair(buf, 200)
        return {"masked": list(buf.masked_ranks), "raised": raised}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ["numba", "torch"])  # the compiled receive half, and the torch statement
def test_a_rank_killed_between_two_homes_puts_is_masked_and_every_survivor_finishes_in_step(engine):
    outcomes = ubep.LocalLaunch(world_size=WORLD, timeout_s=100).outcomes(killed_between_two_puts, engine)
    assert outcomes[DEAD].cause == "died", outcomes[DEAD]
    for o in outcomes:
        if o.rank != DEAD:
            assert o.ok and o.result == {"masked": [DEAD], "raised": []}, (o.rank, o.cause, o.error, o.result)


def test_the_option_comes_from_its_variable_and_is_checked(monkeypatch):
    def one_rank(**kw) -> ubep.Buffer:
        return ubep.Buffer(hidden=64, num_experts=4, max_tokens_per_rank=4, **kw)

    monkeypatch.setenv("UBEP_ON_PEER_FAILURE", "mask")
    with one_rank() as buf:
        assert buf.on_peer_failure == "mask"
        assert "on_peer_failure 'mask' (from UBEP_ON_PEER_FAILURE)" in buf.explain()
    with one_rank(on_peer_failure="raise") as buf:  # the argument wins
        assert "on_peer_failure 'raise' (argument)" in buf.explain()
    monkeypatch.setenv("UBEP_ON_PEER_FAILURE", "retry")
    with pytest.raises(ValueError, match="UBEP_ON_PEER_FAILURE='retry'"):
        one_rank()
    monkeypatch.delenv("UBEP_ON_PEER_FAILURE")
    with pytest.raises(ValueError, match="on_peer_failure must be one of"):
        one_rank(on_peer_failure="drop")
    with one_rank() as buf:
        assert buf.on_peer_failure == "raise"

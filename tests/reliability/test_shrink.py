"""Shrinking around a dead rank (`Buffer.mask_ranks`): the ranks that stay mask it and keep
calling, each call exact against the reference restricted to them (`shrinkcase`)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
from faultcase import group_pids, residue
from shrinkcase import NUM_EXPERTS_PER_RANK, buffer, inputs, low_latency_call, normal_call
from test_low_latency import CAPACITY, HIDDEN

import ubep
from ubep import reference
from ubep.calls import CallId
from ubep.compat.deep_ep import Buffer as DeepEPBuffer
from ubep.errors import CommTimeoutError, UbepError
from ubep.faults import FaultPlan
from ubep.placement import Placement
from ubep.transport.heap import CAUSE_OWN, CAUSE_SILENT
from ubep.transport.virtual import VirtualRank, VirtualWorld

DEAD = 2
ITERATIONS_AFTER = 50  # dispatch + combine pairs on the survivors after the mask: 100 calls


def leave_one_by_one(rank: VirtualRank, protocol: str, done: list[threading.Barrier]) -> list[int]:
    """Ranks 2, then 3 leave (each masks itself, the others mask it); the rest keep calling.

    A rank that the others mask while it is still inside a call gets MaskedOutError there (they
    went on, and may reuse what it reads); `done` lets a leaving rank finish its last call first.
    """
    me = rank.rank
    with buffer(rank, protocol, timeout_s=20) as buf:
        for seed in range(3):
            normal_call(buf, seed, set())
        xs, idxs, ws = inputs(3, rank.world_size)
        old = buf.dispatch(xs[me], topk_idx=idxs[me], topk_weights=ws[me])  # routes through rank 2
        done[0].wait()
        buf.mask_ranks([2])
        if me == 2:
            with pytest.raises(RuntimeError, match="masked itself out"):
                normal_call(buf, 99, set())
            return []
        with pytest.raises(ValueError, match="before rank"):  # every staying rank rejects it: in step
            buf.combine(old.recv_x, old.handle)
        for seed in range(100, 120):
            normal_call(buf, seed, {2})
        for seed in range(200, 203):
            low_latency_call(buf, seed, {2})
        done[1].wait()
        buf.mask_ranks([3])
        if me == 3:
            return list(buf.masked_ranks)
        for seed in range(300, 310):
            normal_call(buf, seed, {2, 3})
        low_latency_call(buf, 400, {2, 3})
        return list(buf.masked_ranks)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("protocol", ["ubep", "bsp"])
def test_ranks_leave_one_by_one_and_the_rest_stay_exact(protocol):
    done = [threading.Barrier(4), threading.Barrier(3)]
    got = VirtualWorld(4, timeout_s=100).run(lambda rank: leave_one_by_one(rank, protocol, done))
    assert got == [[2, 3], [2, 3], [], [2]]


def killed_then_masked(protocol: str, point: str) -> dict:
    """Rank DEAD is SIGKILLed at `point` of call 7; the others run until a call fails, check that
    it names DEAD, mask it, and run ITERATIONS_AFTER checked iterations without it."""
    me = dist.get_rank()
    pids = group_pids()
    plan = FaultPlan(rank=DEAD, point=point, action="kill", call=7)
    with buffer(None, protocol, timeout_s=5, faults=plan) as buf:
        seed = 0
        try:
            while seed < 10:
                normal_call(buf, seed, set())
                seed += 1
        except UbepError as error:
            failed = (seed, type(error).__name__, str(error))
        else:
            raise AssertionError("the killed rank was never noticed")
        assert f"rank(s) {DEAD}" in failed[2] or f"rank {DEAD}" in failed[2], failed
        buf.mask_ranks([DEAD])
        for seed in range(1000, 1000 + ITERATIONS_AFTER):
            normal_call(buf, seed, {DEAD})
        for seed in range(2000, 2003):
            low_latency_call(buf, seed, {DEAD})
    return {"failed": failed, "left": residue(pids - {os.getpid()}) if me == 0 else []}


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "protocol,point", [("ubep", "dispatch.sent"), ("ubep", "dispatch.start"), ("bsp", "dispatch.sent")]
)
def test_a_killed_rank_is_masked_and_the_survivors_go_on_exact(protocol, point):
    outcomes = ubep.LocalLaunch(world_size=4, timeout_s=150).outcomes(killed_then_masked, protocol, point)
    assert outcomes[DEAD].cause == "died", outcomes[DEAD]
    for rank in (0, 1, 3):
        assert outcomes[rank].ok, (rank, outcomes[rank].cause, outcomes[rank].error)
    assert outcomes[0].result["left"] == []


def placement_after_a_death() -> tuple[list[int], str]:
    """Rank DEAD of 3 dies after a call; the survivors set a placement before masking it, then after."""
    me = dist.get_rank()
    with buffer(None, "ubep", timeout_s=5) as buf:
        normal_call(buf, 0, set())
        if me == DEAD:
            os.kill(os.getpid(), signal.SIGKILL)
        placement = Placement.identity(buf.num_experts, buf.num_ranks)
        with pytest.raises(CommTimeoutError) as unmasked:
            buf.set_placement(placement)
        buf.mask_ranks([DEAD])
        with pytest.raises(ValueError) as masked:  # the staying ranks agree; DEAD's experts have no copy
            buf.set_placement(placement)
        normal_call(buf, 1, {DEAD})  # and the Buffer goes on without it, exact
    return unmasked.value.dead_peers, str(masked.value)


@pytest.mark.timeout(120)
def test_set_placement_around_a_dead_rank_names_it():
    """Issue 32, item 10: both raised naming the other ranks as candidates ("torch.distributed does
    not say which of them"), the dead rank among them."""
    outcomes = ubep.LocalLaunch(world_size=3, timeout_s=100).outcomes(placement_after_a_death)
    assert outcomes[DEAD].cause == "died", outcomes[DEAD]
    for o in outcomes[:DEAD]:
        assert o.ok, (o.rank, o.cause, o.error)
        dead, refused = o.result
        assert dead == [DEAD], (o.rank, dead)
        said = f"placement puts logical expert(s) [4, 5] only on masked rank(s) [{DEAD}]"
        assert refused.startswith(said), (o.rank, refused)


def stalled_then_masked(rank: VirtualRank, protocol: str, awake: threading.Event) -> str:
    """Rank 2 stalls past the deadline; the others mask it and go on. When it wakes, its next call
    must fail without writing into their memory (low-latency sends put rows there)."""
    with buffer(rank, protocol, timeout_s=2) as buf:
        normal_call(buf, 0, set())
        low_latency_call(buf, 1, set())
        if rank.rank == 2:
            time.sleep(5)
            awake.set()
            with pytest.raises(ubep.MaskedOutError, match="masked rank 2 out"):
                low_latency_call(buf, 2, set())
            return "masked out"
        with pytest.raises(UbepError, match=r"rank\(s\) 2|because rank 2"):  # silent, or named by a peer
            normal_call(buf, 2, set())
        buf.mask_ranks([2])
        low_latency_call(buf, 100, {2})
        awake.wait(30)
        for seed in range(101, 121):  # calls while rank 2 tries its own
            low_latency_call(buf, seed, {2})
            normal_call(buf, seed + 1000, {2})
        return "exact"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("protocol", ["ubep", "bsp"])
def test_a_stalled_rank_masked_by_the_others_cannot_write_into_them_when_it_wakes(protocol):
    awake = threading.Event()
    got = VirtualWorld(3, timeout_s=50).run(lambda rank: stalled_then_masked(rank, protocol, awake))
    assert got == ["exact", "exact", "masked out"]


def deep_ep_shrink(rank: VirtualRank, done: threading.Barrier) -> list[int]:
    """DeepEP's mask-buffer calls through the compat layer: rank 2 is masked by everyone (it leaves),
    the others run low-latency calls without it, exact against the restricted reference."""
    from shrinkcase import expert_output

    R, E, me = rank.world_size, NUM_EXPERTS_PER_RANK * rank.world_size, rank.rank
    hint = DeepEPBuffer.get_low_latency_rdma_size_hint(CAPACITY, HIDDEN, R, E)
    buf = DeepEPBuffer(rank, num_rdma_bytes=hint, low_latency_mode=True, enable_shrink=True)
    status = torch.zeros(R, dtype=torch.int32)
    for seed, masked in ((0, set()), (1, {2}), (2, {2})):
        if seed == 1:
            done.wait()  # rank 2 finishes its last call before the others mask it
            buf.low_latency_update_mask_buffer(2, True)
            if me == 2:
                break
        xs, idxs, ws = inputs(seed, R)
        rx, ri, rw = reference.without_ranks(xs, idxs, ws, masked, E)
        ref = reference.low_latency_dispatch(rx, ri, E, CAPACITY)
        recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(
            xs[me], idxs[me], CAPACITY, E, use_fp8=False
        )
        assert torch.equal(recv_count, ref[me].recv_count_L)
        ys = [expert_output(r.recv_x_LMX, q) for q, r in enumerate(ref)]
        combined, _, _ = buf.low_latency_combine(ys[me], idxs[me], ws[me], handle)
        assert torch.equal(combined, reference.low_latency_combine(ys, ref, ri, rw)[me])
    buf.low_latency_query_mask_buffer(status)
    buf.destroy()
    return status.tolist()


@pytest.mark.timeout(60)
def test_deep_ep_mask_buffer_masks_a_rank_and_the_rest_go_on():
    done = threading.Barrier(3)
    assert VirtualWorld(3, timeout_s=50).run(lambda rank: deep_ep_shrink(rank, done)) == [[0, 0, 1]] * 3


def disagree(rank: VirtualRank, done: threading.Barrier) -> str:
    with buffer(rank, "ubep", timeout_s=3) as buf:
        normal_call(buf, 0, set())
        done.wait()  # the leaving ranks finish their call before anyone masks them
        try:
            buf.mask_ranks([2] if rank.rank == 0 else [2, 3] if rank.rank == 1 else [rank.rank])
        except (UbepError, CommTimeoutError) as error:
            return type(error).__name__
        return "masked"


@pytest.mark.timeout(60)
def test_ranks_that_disagree_on_whom_to_mask_raise():
    done = threading.Barrier(4)
    got = VirtualWorld(4, timeout_s=50).run(lambda rank: disagree(rank, done))
    assert got[2] == "masked" and got[3] == "masked"  # they left
    assert got[0] != "masked" and got[1] != "masked", got


def test_masking_needs_a_heap_and_ranks_in_range():
    with ubep.Buffer(hidden=64, num_experts=4, max_tokens_per_rank=4) as buf:  # one rank: local
        with pytest.raises(ValueError, match="must lie in"):
            buf.mask_ranks([5])
        with pytest.raises(NotImplementedError, match="shared heap"):
            buf.mask_ranks([])


def failed_before(rank: VirtualRank, protocol: str, done: threading.Barrier, masked: set[int]) -> str:
    """Rank 1's notice says it failed the last call where rank 0 completed it: it timed out on rank
    2, which the ranks then mask (`masked` {2}), or it rejected its own input (no mask). Rank 1
    then starts its next call late; rank 0 must wait for it, not take the old notice for a rank
    left behind (the fault soak found the first case: its stop episodes failed)."""
    me = rank.rank
    with buffer(rank, protocol, timeout_s=20) as buf:
        normal_call(buf, 0, set())
        heap = buf._exchange.t
        done.wait(60)  # every rank finished the call before rank 1 says it failed it (a rank still in
        # its combine takes the notice as this call's, rightly: seen under load)
        if me == 1:
            heap.abort(
                CallId(heap._current_seq, 0), CAUSE_SILENT if masked else CAUSE_OWN, 2 if masked else -1
            )
        done.wait(60)  # the notice is out before any rank masks or starts its next call
        if masked:
            buf.mask_ranks(sorted(masked))
        if me in masked:
            return ""
        if me == 1:
            time.sleep(0.3)  # several liveness checks of rank 0's wait
        try:
            for seed in range(1, 4):
                normal_call(buf, seed, masked)
        except UbepError as error:
            return str(error)
        return ""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("masked", [{2}, set()], ids=["timed-out-then-mask", "rejected-own-input"])
@pytest.mark.parametrize("protocol", ["ubep", "bsp"])
def test_an_old_notice_does_not_fail_later_calls(protocol, masked):
    done = threading.Barrier(3)
    said = VirtualWorld(3, timeout_s=100).run(lambda rank: failed_before(rank, protocol, done, masked))
    assert said == ["", "", ""], said

"""The DeepEP layers after a mask (issue 43, item 5): V1's `deep_ep.Buffer` in normal mode after
its mask-buffer calls (dispatch by top-k and by is_token_in_rank alone, cached dispatch, combine),
and V2's `ElasticBuffer` with ubep's mask and on_peer_failure="mask". Every call after the mask is
checked bit for bit against the reference fed the ranks that stay (`reference.without_ranks`): a
masked rank sends nothing, and every top-k entry that selects its experts is dropped."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch
import torch.distributed as dist
from scenarios import expert_output
from shrinkcase import NUM_EXPERTS_PER_RANK, inputs
from test_low_latency import CAPACITY, HIDDEN

import ubep
from ubep import reference
from ubep.compat.deep_ep import Buffer as DeepEPBuffer
from ubep.compat.deep_ep import Config, ElasticBuffer
from ubep.errors import UbepError
from ubep.transport.virtual import VirtualRank, VirtualWorld

ITERATIONS_AFTER = 15  # V1: 4 calls each (dispatch, cached dispatch, combine, is_token_in_rank dispatch)
ELASTIC_AFTER = 25  # ElasticBuffer: dispatch + combine pairs


def rank_prefix(ref: list[reference.RefDispatch], R: int) -> torch.Tensor:
    """int32 [R, R]: DeepEP's rank_prefix_matrix from the reference, [i, j] = tokens ranks 0..i send to j."""
    sent_RR = torch.tensor(
        [[int((ref[j].src_rank_M == i).sum()) for j in range(R)] for i in range(R)], dtype=torch.int64
    )
    return sent_RR.cumsum(dim=0).to(torch.int32)


def v1_normal_calls(buf: DeepEPBuffer, seed: int, masked: set[int]) -> None:
    """Dispatch by top-k, cached dispatch, combine, then dispatch by is_token_in_rank alone, each
    against the reference restricted to the staying ranks."""
    me, R = buf.rank, buf.group_size
    E = NUM_EXPERTS_PER_RANK * R
    xs, idxs, ws = inputs(seed, R)
    rx, ri, rw = reference.without_ranks(xs, idxs, ws, masked, E)
    ref = reference.dispatch(rx, ri, rw, E)
    where = f"call {seed} rank {me} masked {sorted(masked)}"
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idxs[me], E)
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
        xs[me],
        topk_idx=idxs[me],
        topk_weights=ws[me],
        num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
    )
    assert torch.equal(recv_x, ref[me].recv_x_MH), where
    assert torch.equal(recv_idx, ref[me].recv_topk_idx_MK), where
    assert torch.equal(recv_w, ref[me].recv_topk_weights_MK), where
    assert counts == ref[me].num_recv_tokens_per_expert, where
    assert torch.equal(handle.rank_prefix_matrix, rank_prefix(ref, R)), where
    assert torch.equal(handle.recv_src_idx.long(), ref[me].src_token_M), where
    doubled = [(x.float() * 2).bfloat16() for x in rx]
    again = buf.dispatch((xs[me].float() * 2).bfloat16(), handle=handle)[0]
    assert torch.equal(again, reference.dispatch(doubled, ri, rw, E)[me].recv_x_MH), where
    combined, _, _ = buf.combine(expert_output(recv_x, me), handle)
    ys = [expert_output(r.recv_x_MH, q) for q, r in enumerate(ref)]
    assert torch.equal(combined, reference.combine(ys, ref, [x.shape[0] for x in rx])[me]), where
    by_rank = buf.dispatch(xs[me], is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    assert torch.equal(by_rank[0], ref[me].recv_x_MH), where
    assert by_rank[3] == ref[me].num_recv_tokens_per_expert, where


def v1_buffer(group, R: int) -> DeepEPBuffer:
    return DeepEPBuffer(group, Config().get_nvl_buffer_size_hint(HIDDEN * 2, R), enable_shrink=True)


def v1_leave(rank: VirtualRank, done: threading.Barrier) -> list[int]:
    """Rank 2 leaves after three calls (every rank masks it, it too); the others go on."""
    me, R = rank.rank, rank.world_size
    buf = v1_buffer(rank, R)
    for seed in range(3):
        v1_normal_calls(buf, seed, set())
    done.wait()  # rank 2 finishes its last call before the others mask it
    buf.low_latency_update_mask_buffer(2, True)
    status = torch.zeros(R, dtype=torch.int32)
    buf.low_latency_query_mask_buffer(status)
    if me != 2:
        buf.low_latency_update_mask_buffer(2, True)  # masked already: nothing happens
        for seed in range(100, 100 + ITERATIONS_AFTER):
            v1_normal_calls(buf, seed, {2})
        with pytest.raises(NotImplementedError, match="rejoin"):
            buf.low_latency_update_mask_buffer(2, False)
    buf.destroy()
    return status.tolist()


@pytest.mark.timeout(150)
def test_v1_normal_mode_after_a_rank_leaves_is_exact_on_the_rest():
    done = threading.Barrier(4)
    got = VirtualWorld(4, timeout_s=140).run(lambda rank: v1_leave(rank, done))
    assert got == [[0, 0, 1, 0]] * 4


def v1_both_modes(rank: VirtualRank, done: threading.Barrier) -> str:
    """The mask between a dispatch and its combine, on a Buffer that ran both modes: the stale
    combine is refused on every staying rank alike, then both modes go on exact without rank 2."""
    me, R = rank.rank, rank.world_size
    E = NUM_EXPERTS_PER_RANK * R
    ll_bytes = DeepEPBuffer.get_low_latency_rdma_size_hint(CAPACITY, HIDDEN, R, E)
    nvl_bytes = Config().get_nvl_buffer_size_hint(HIDDEN * 2, R)
    buf = DeepEPBuffer(rank, nvl_bytes, ll_bytes, low_latency_mode=True, enable_shrink=True)
    v1_normal_calls(buf, 0, set())
    xs, idxs, ws = inputs(1, R)
    per_expert = buf.get_dispatch_layout(idxs[me], E)[2]
    recv_x, _, _, _, stale, _ = buf.dispatch(
        xs[me], topk_idx=idxs[me], topk_weights=ws[me], num_tokens_per_expert=per_expert
    )
    buf.low_latency_dispatch(xs[me], idxs[me], CAPACITY, E, use_fp8=False)  # the low-latency buffer
    done.wait()
    buf.low_latency_update_mask_buffer(2, True)
    if me == 2:
        return "left"
    with pytest.raises(ValueError, match="before rank"):
        buf.combine(recv_x, stale)
    for seed in range(10, 13):
        v1_normal_calls(buf, seed, {2})
        xs, idxs, ws = inputs(seed, R)
        rx, ri, rw = reference.without_ranks(xs, idxs, ws, {2}, E)
        ref = reference.low_latency_dispatch(rx, ri, E, CAPACITY)
        _, recv_count, handle, _, _ = buf.low_latency_dispatch(xs[me], idxs[me], CAPACITY, E, use_fp8=False)
        assert torch.equal(recv_count, ref[me].recv_count_L)
        ys = [expert_output(r.recv_x_LMX, q) for q, r in enumerate(ref)]
        combined, _, _ = buf.low_latency_combine(ys[me], idxs[me], ws[me], handle)
        assert torch.equal(combined, reference.low_latency_combine(ys, ref, ri, rw)[me])
    buf.destroy()
    return "exact"


@pytest.mark.timeout(120)
def test_v1_mask_between_a_dispatch_and_its_combine_in_both_modes():
    done = threading.Barrier(3)
    got = VirtualWorld(3, timeout_s=110).run(lambda rank: v1_both_modes(rank, done))
    assert got == ["exact", "exact", "left"]


def v1_killed(on_peer_failure: str) -> dict:
    """Rank 2 of 4 dies between calls. Under "raise" the survivors' next call raises naming it and
    they mask it with the mask-buffer call; under "mask" (UBEP_ON_PEER_FAILURE, as vLLM's fault
    tolerance expects of DeepEP's kernels) that call masks it and finishes without it, and the
    mask buffer reports it. Then ITERATIONS_AFTER checked iterations in normal mode."""
    me, R = dist.get_rank(), dist.get_world_size()
    os.environ["UBEP_TIMEOUT_S"] = "10"  # the V1 layer's ubep Buffers (this rank process only)
    os.environ["UBEP_ON_PEER_FAILURE"] = on_peer_failure
    buf = v1_buffer(None, R)
    for seed in range(2):
        v1_normal_calls(buf, seed, set())
    if me == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    said = ""
    if on_peer_failure == "raise":
        with pytest.raises(UbepError) as met:
            v1_normal_calls(buf, 2, set())
        said = str(met.value)
        buf.low_latency_update_mask_buffer(2, True)
    status = torch.zeros(R, dtype=torch.int32)
    for seed in range(100, 100 + ITERATIONS_AFTER):
        v1_normal_calls(buf, seed, {2})
    buf.low_latency_query_mask_buffer(status)
    buf.destroy()
    return {"said": said, "status": status.tolist()}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("on_peer_failure", ["raise", "mask"])
def test_v1_normal_mode_after_a_killed_rank_is_masked_is_exact_on_the_rest(on_peer_failure):
    outcomes = ubep.LocalLaunch(world_size=4, timeout_s=220).outcomes(v1_killed, on_peer_failure)
    assert outcomes[2].cause == "died", outcomes[2]
    for rank in (0, 1, 3):
        assert outcomes[rank].ok, (rank, outcomes[rank].cause, outcomes[rank].error)
        said = outcomes[rank].result["said"]
        assert on_peer_failure == "mask" or "rank(s) 2" in said or "rank 2" in said, said
        assert outcomes[rank].result["status"] == [0, 0, 1, 0]


# -- ElasticBuffer ----------------------------------------------------------------------------------


def integer_output(recv_x: torch.Tensor, rank: int) -> torch.Tensor:
    """Expert outputs that are small integers: their float32 sums are exact in any order, so the
    reference's plain sum is DeepEP V2's ordered one."""
    return (recv_x.float() * 4 + rank).round().clamp(-60, 60).to(recv_x.dtype)


def elastic_pair(buf: ElasticBuffer, seed: int, masked: set[int]) -> None:
    """One ElasticBuffer dispatch and combine against the reference restricted to `masked`'s complement."""
    me, R = buf.rank_idx, buf.num_ranks
    E = NUM_EXPERTS_PER_RANK * R
    xs, idxs, ws = inputs(seed, R)
    recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(
        xs[me], topk_idx=idxs[me], topk_weights=ws[me], num_experts=E
    )
    masked = set(buf.masked_ranks) | masked  # a call that met a dead rank masked it
    rx, ri, rw = reference.without_ranks(xs, idxs, ws, masked, E)
    ref = reference.dispatch(rx, ri, rw, E)
    where = f"elastic call {seed} rank {me} masked {sorted(masked)}"
    M = ref[me].recv_x_MH.shape[0]
    assert torch.equal(recv_x[:M], ref[me].recv_x_MH), where
    assert torch.equal(recv_idx[:M], ref[me].recv_topk_idx_MK), where
    assert torch.equal(recv_w[:M], ref[me].recv_topk_weights_MK), where
    combined, _, _ = buf.combine(integer_output(recv_x, me), handle)
    ys = [integer_output(r.recv_x_MH, q) for q, r in enumerate(ref)]
    assert torch.equal(combined, reference.combine(ys, ref, [x.shape[0] for x in rx])[me]), where


def elastic_buffer(group, **kw) -> ElasticBuffer:
    return ElasticBuffer(group, num_max_tokens_per_rank=CAPACITY, hidden=HIDDEN, num_topk=3, **kw)


def elastic_leave(rank: VirtualRank, done: threading.Barrier) -> tuple[int, ...]:
    """Rank 1 of 3 leaves through `mask_ranks`; the others go on, exact."""
    buf = elastic_buffer(rank, explicitly_destroy=True)
    for seed in range(2):
        elastic_pair(buf, seed, set())
    done.wait()
    buf.mask_ranks([1])
    if rank.rank != 1:
        for seed in range(100, 110):
            elastic_pair(buf, seed, {1})
        with pytest.raises(NotImplementedError, match="rejoin"):
            buf.unmask_ranks([1])
    else:
        with pytest.raises(RuntimeError, match="masked itself out"):
            elastic_pair(buf, 99, set())
    status = torch.zeros(3, dtype=torch.int64)
    buf.query_mask_buffer(status)
    assert status.tolist() == [0, 1, 0]
    buf.destroy()
    return buf.masked_ranks


@pytest.mark.timeout(120)
def test_elastic_buffer_mask_ranks_leaves_a_rank_out_exactly():
    done = threading.Barrier(3)
    assert VirtualWorld(3, timeout_s=110).run(lambda rank: elastic_leave(rank, done)) == [(1,)] * 3


def elastic_killed() -> tuple[int, ...]:
    """ElasticBuffer(on_peer_failure="mask"): rank 2 of 4 dies between calls; the survivors' next
    call meets it, masks it and finishes without it; then ELASTIC_AFTER more checked pairs."""
    me = dist.get_rank()
    buf = elastic_buffer(None, on_peer_failure="mask", num_cpu_timeout_secs=10, explicitly_destroy=True)
    for seed in range(2):
        elastic_pair(buf, seed, set())
    if me == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    for seed in range(100, 100 + ELASTIC_AFTER):
        elastic_pair(buf, seed, {2})
    buf.destroy()
    return buf.masked_ranks


@pytest.mark.timeout(240)
def test_elastic_buffer_on_peer_failure_mask_finishes_without_a_killed_rank():
    outcomes = ubep.LocalLaunch(world_size=4, timeout_s=220).outcomes(elastic_killed)
    assert outcomes[2].cause == "died", outcomes[2]
    for rank in (0, 1, 3):
        assert outcomes[rank].ok, (rank, outcomes[rank].cause, outcomes[rank].error)
        assert outcomes[rank].result == (2,)

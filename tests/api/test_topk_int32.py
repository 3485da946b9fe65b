"""int32 expert ids (vLLM's `topk_ids`) are accepted and routed exactly as int64 ones, in every mode,
on two virtual ranks (threads of this process), checked against the plain-torch reference."""

from __future__ import annotations

import pytest
import torch

import ubep
from ubep import reference, routing
from ubep.transport.virtual import VirtualRank, VirtualWorld

R, H, E, K, N = 2, 64, 8, 3, 6


def inputs() -> tuple[list, list, list]:
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(N, H, generator=gen).to(torch.bfloat16) for _ in range(R)]
    idxs = [routing.drop(routing.uniform(N, E, K, gen), 0.2, gen) for _ in range(R)]
    return xs, idxs, [routing.weights(N, K, gen) for _ in range(R)]


def both_modes(rank: VirtualRank, engine: str) -> bool:
    xs, idxs, ws = inputs()
    me = rank.rank
    x, idx32, w = xs[me], idxs[me].to(torch.int32), ws[me]
    ref = reference.dispatch(xs, idxs, ws, E)
    with ubep.Buffer(
        rank, hidden=H, num_experts=E, max_tokens_per_rank=N, engine=engine, timeout_s=20, low_latency=True
    ) as buf:
        layout = buf.get_dispatch_layout(idx32, E)
        got = buf.dispatch(x, topk_idx=idx32, topk_weights=w)
        combined = buf.combine(got.recv_x, got.handle).combined_x
        ll = buf.low_latency_dispatch(x, idx32, N, E)
        ll_combined = buf.low_latency_combine(ll.recv_x, idx32, w, ll.handle).combined_x
    ll_ref = reference.low_latency_dispatch(xs, idxs, E, N)
    ll_want = reference.low_latency_combine([r.recv_x_LMX for r in ll_ref], ll_ref, idxs, ws)[me]
    want = reference.combine([r.recv_x_MH for r in ref], ref, [N] * R)[me]
    sent_R = torch.tensor(
        [int(((idxs[me] >= 0) & (idxs[me] // (E // R) == r)).any(1).sum()) for r in range(R)]
    )
    return (
        torch.equal(layout.num_tokens_per_rank.long(), sent_R)
        and torch.equal(got.recv_x, ref[me].recv_x_MH)
        and torch.equal(got.recv_topk_idx, ref[me].recv_topk_idx_MK)
        and torch.equal(combined, want)
        and torch.equal(ll.recv_count, ll_ref[me].recv_count_L)
        and torch.equal(ll_combined, ll_want)
    )


@pytest.mark.timeout(180)
@pytest.mark.parametrize("engine", ["torch", "numba"])
def test_int32_topk_idx_routes_as_int64(engine):
    assert VirtualWorld(R, timeout_s=150).run(lambda rank: both_modes(rank, engine)) == [True] * R

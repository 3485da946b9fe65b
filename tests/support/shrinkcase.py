"""Checked calls for shrinking tests: every rank's inputs for call `seed` (the same on every rank),
and the reference fed them as the ranks that stay see them (`reference.without_ranks`: a masked
rank holds no tokens, and every top-k entry selecting one of its experts is dropped)."""

from __future__ import annotations

import torch
from scenarios import assert_dispatch_matches, expert_output
from test_low_latency import CAPACITY, HIDDEN, LLCase, check_dispatch

import ubep
from ubep import reference

NUM_EXPERTS_PER_RANK, TOPK = 2, 3


def inputs(seed: int, R: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Every rank's (x bf16 [n, H], topk_idx [n, K] with some -1, topk_weights [n, K]) for one call."""
    g = torch.Generator().manual_seed(seed)
    E = NUM_EXPERTS_PER_RANK * R
    xs, idxs, ws = [], [], []
    for _ in range(R):
        n = int(torch.randint(0, CAPACITY + 1, (1,), generator=g))
        idx = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(n)] or [torch.empty(0, 3)])
        idx = idx.view(n, TOPK).long()
        idx[torch.rand(n, TOPK, generator=g) < 0.1] = -1
        xs.append(torch.randn(n, HIDDEN, generator=g).to(torch.bfloat16))
        idxs.append(idx)
        ws.append(torch.rand(n, TOPK, generator=g))
    return xs, idxs, ws


def _case(buf: ubep.Buffer, seed: int, masked: set[int]):
    """(rank, R, E, the inputs, the inputs as the reference sees them) for call `seed`."""
    R = buf.num_ranks
    xs, idxs, ws = inputs(seed, R)
    E = NUM_EXPERTS_PER_RANK * R
    return buf.rank, R, E, (xs, idxs, ws), reference.without_ranks(xs, idxs, ws, masked, E)


def normal_call(buf: ubep.Buffer, seed: int, masked: set[int]) -> None:
    """One dispatch and one combine on this rank, checked bit for bit against the restricted reference."""
    me, R, E, (xs, idxs, ws), (rx, ri, rw) = _case(buf, seed, masked)
    ref = reference.dispatch(rx, ri, rw, E)
    where = f"call {seed} rank {me} masked {sorted(masked)}"
    got = buf.dispatch(xs[me], topk_idx=idxs[me], topk_weights=ws[me])
    assert_dispatch_matches(got, ref[me], where)
    assert got.handle.num_dropped == int(((idxs[me] >= 0) & (ri[me] < 0)).sum()), where
    ys = [expert_output(ref[r].recv_x_MH, r) for r in range(R)]
    want = reference.combine(ys, ref, [x.shape[0] for x in rx])[me]
    out = buf.combine(expert_output(got.recv_x, me), got.handle, topk_weights=got.recv_topk_weights)
    assert torch.equal(out.combined_x, want), where
    assert torch.equal(out.combined_topk_weights, torch.where(ri[me] >= 0, rw[me], 0.0)), where


def low_latency_call(buf: ubep.Buffer, seed: int, masked: set[int]) -> None:
    """One low-latency dispatch and combine, checked against the restricted reference."""
    me, R, E, (xs, idxs, ws), (rx, ri, rw) = _case(buf, seed, masked)
    ref = reference.low_latency_dispatch(rx, ri, E, CAPACITY)
    where = f"low-latency call {seed} rank {me} masked {sorted(masked)}"
    got = buf.low_latency_dispatch(xs[me], idxs[me], CAPACITY, E)
    check_dispatch(got, ref[me], None, LLCase(name="shrink"), R, where)
    ys = [expert_output(r.recv_x_LMX, rank) for rank, r in enumerate(ref)]
    want = reference.low_latency_combine(ys, ref, ri, rw)[me]
    out = buf.low_latency_combine(ys[me], idxs[me], ws[me], got.handle)
    assert torch.equal(out.combined_x, want), where


def buffer(group, protocol: str, timeout_s: float, low_latency: bool = True, **kw) -> ubep.Buffer:
    R = group.world_size if hasattr(group, "world_size") else torch.distributed.get_world_size()
    return ubep.Buffer(
        group,
        hidden=HIDDEN,
        num_experts=NUM_EXPERTS_PER_RANK * R,
        max_tokens_per_rank=CAPACITY,
        max_topk=TOPK,
        protocol=protocol,
        timeout_s=timeout_s,
        low_latency=low_latency,
        **kw,
    )

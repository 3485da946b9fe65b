"""Rebalancing experts in a running job: record the loads, place by load and distance, move the
expert weights with torch.distributed, `set_placement`, and carry on (docs/placement.md).

Run it from ubep's clone: `python examples/placement.py` (4 local ranks in 2 emulated nodes,
`ubep.LocalLaunch(world_size=4, ranks_per_node=2).run(rebalance_step)`); it prints how far
each rank's layer outputs moved across the rebalance.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import ubep
from ubep import routing
from ubep.placement import Distances, Placement, balance

E, SLOTS, H, K, N = 8, 3, 32, 2, 16  # logical experts, slots per rank, hidden, top-k, tokens per rank


def expert_weight(e: int) -> torch.Tensor:
    """Logical expert e's weight [H, H] (a stand-in: made from its id, so the check can rebuild it)."""
    return torch.randn(H, H, generator=torch.Generator().manual_seed(100 + e)) / H**0.5


def moe(buf: ubep.Buffer, x, idx, w, weights_LHH: torch.Tensor) -> torch.Tensor:
    """One MoE layer: dispatch, every local slot's expert on its rows, combine."""
    got = buf.dispatch(x, topk_idx=idx, topk_weights=w)
    y = torch.zeros_like(got.recv_x)
    for k in range(got.recv_topk_idx.shape[1]):
        slot, valid = got.recv_topk_idx[:, k], got.recv_topk_idx[:, k] >= 0
        y_MH = torch.bmm(got.recv_x[:, None], weights_LHH[slot.clamp(min=0)])[:, 0]
        y += torch.where(valid, got.recv_topk_weights[:, k], 0.0)[:, None] * y_MH
    return buf.combine(y, got.handle).combined_x


def move_weights(old: Placement, new: Placement, weights_LHH: torch.Tensor) -> torch.Tensor:
    """This rank's slot weights under `new`: kept where it already held the expert, else received
    from the lowest rank that held it under `old` (which sends it)."""
    me, R = dist.get_rank(), new.num_ranks
    holder_E = [int(old.rank_of_physical_U[old.physical_of_logical_EJ()[e, 0]]) for e in range(E)]
    mine = old.local_logical(me).tolist()
    out, pending = torch.empty_like(weights_LHH), []
    for r in range(R):
        theirs = old.local_logical(r).tolist()
        for j, e in enumerate(new.local_logical(r).tolist()):
            if e in theirs:
                if r == me:
                    out[j] = weights_LHH[mine.index(e)]
            elif r == me:
                pending.append(dist.irecv(out[j], src=holder_E[e], tag=j))
            elif holder_E[e] == me:
                pending.append(dist.isend(weights_LHH[mine.index(e)].contiguous(), dst=r, tag=j))
    for request in pending:
        request.wait()
    return out


def rebalance_step() -> float:
    """Two steps of one MoE layer around a rebalance; returns how far their outputs differ."""
    me, R = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(me)
    x, idx, w = torch.randn(N, H, generator=gen), routing.zipf(N, E, K, 1.2, gen), routing.weights(N, K, gen)
    with ubep.Buffer(hidden=H, num_experts=R * SLOTS, max_tokens_per_rank=N) as buf:
        old = Placement(R, E, torch.arange(R * SLOTS) % E)  # a starting placement: the first experts twice
        buf.set_placement(old)
        weights = torch.stack([expert_weight(int(e)) for e in old.local_logical(me)])
        before = moe(buf, x, idx, w, weights)

        counts_E = torch.bincount(idx.flatten(), minlength=E)  # this rank's pairs per expert
        load_RE = [torch.empty_like(counts_E) for _ in range(R)]
        dist.all_gather(load_RE, counts_E)  # every rank sees every source's loads...
        nodes = Distances.from_nodes([r // 2 for r in range(R)])
        new = balance(torch.stack(load_RE), nodes, SLOTS)  # ...and computes the same placement
        weights = move_weights(old, new, weights)
        buf.set_placement(new)  # collective: checked for agreement on every rank
        after = moe(buf, x, idx, w, weights)
    return float((after - before).abs().max())


if __name__ == "__main__":
    diffs = ubep.LocalLaunch(world_size=4, ranks_per_node=2).run(rebalance_step)
    for rank, diff in enumerate(diffs):
        print(f"rank {rank}: outputs before and after rebalancing differ by at most {diff:.1e}")

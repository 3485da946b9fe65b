"""The semantics in plain torch: the test oracle and the one-rank path.

Written for clarity, not speed, and independently of `layout` so that it can
catch that module's mistakes. It sees every rank's inputs at once (a list
indexed by rank) and returns every rank's outputs.

Legend: see `ubep.layout` (N tokens, H hidden, K top-k, R ranks, E experts, M rows).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class RefDispatch(NamedTuple):
    """What one rank receives from a normal-mode dispatch."""

    recv_x_MH: torch.Tensor
    recv_topk_idx_MK: torch.Tensor  # local expert id or -1
    recv_topk_weights_MK: torch.Tensor  # weight where local, else 0
    num_recv_tokens_per_expert: list[int]
    src_rank_M: torch.Tensor  # int64
    src_token_M: torch.Tensor  # int64


def owner_of(expert: torch.Tensor, num_experts: int, num_ranks: int, rank_of_expert=None):
    """Rank owning each expert id (the default contiguous placement unless given)."""
    if rank_of_expert is not None:
        return torch.as_tensor(rank_of_expert)[expert]
    return expert // (num_experts // num_ranks)


def local_id_of(expert: torch.Tensor, num_experts: int, num_ranks: int, rank_of_expert=None):
    """Index of each expert among its owner's experts, ascending by expert id."""
    if rank_of_expert is None:
        return expert % (num_experts // num_ranks)
    owners = torch.as_tensor(rank_of_expert)
    ids = torch.empty_like(owners)
    for r in range(num_ranks):
        mine = torch.nonzero(owners == r).flatten()
        ids[mine] = torch.arange(mine.numel())
    return ids[expert]


def dispatch(
    xs: list[torch.Tensor],
    topk_idxs: list[torch.Tensor],
    topk_weights: list[torch.Tensor],
    num_experts: int,
    expert_alignment: int = 1,
    rank_of_expert=None,
) -> list[RefDispatch]:
    """Every rank's normal-mode dispatch result, from every rank's inputs."""
    num_ranks = len(xs)
    local_experts = num_experts // num_ranks
    results = []
    for dst in range(num_ranks):
        rows, idx_rows, w_rows, src_ranks, src_tokens = [], [], [], [], []
        for src in range(num_ranks):
            idx = topk_idxs[src]
            valid = idx >= 0
            safe = idx.clamp(min=0)
            here = valid & (owner_of(safe, num_experts, num_ranks, rank_of_expert) == dst)
            sent = here.any(dim=1)
            local = local_id_of(safe, num_experts, num_ranks, rank_of_expert)
            rows.append(xs[src][sent])
            idx_rows.append(torch.where(here, local, -1)[sent])
            w_rows.append(torch.where(here, topk_weights[src], 0.0)[sent])
            src_tokens.append(torch.nonzero(sent).flatten())
            src_ranks.append(torch.full((int(sent.sum()),), src, dtype=torch.int64))
        recv_idx = torch.cat(idx_rows)
        counts = [int((recv_idx == j).sum()) for j in range(local_experts)]
        a = expert_alignment
        counts = [(c + a - 1) // a * a for c in counts]
        results.append(
            RefDispatch(
                torch.cat(rows),
                recv_idx,
                torch.cat(w_rows),
                counts,
                torch.cat(src_ranks),
                torch.cat(src_tokens),
            )
        )
    return results


def combine(
    ys: list[torch.Tensor],
    dispatched: list[RefDispatch],
    num_tokens: list[int],
) -> list[torch.Tensor]:
    """Every rank's combined output: per token, the float32 sum over destination ranks.

    `ys[r]` is rank r's expert output, one row per row it received. Sums run in
    ascending order of the rank that sends the row back, then cast to the input dtype.
    """
    num_ranks = len(ys)
    hidden = ys[0].shape[1]
    outs = [torch.zeros(n, hidden, dtype=torch.float32) for n in num_tokens]
    for expert_rank in range(num_ranks):
        got = dispatched[expert_rank]
        for home in range(num_ranks):
            rows = got.src_rank_M == home
            outs[home].index_add_(0, got.src_token_M[rows], ys[expert_rank][rows].float())
    return [out.to(ys[0].dtype) for out in outs]

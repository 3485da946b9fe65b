"""The semantics in plain torch: the test oracle and the one-rank path.

Written for clarity, not speed, and independently of `layout` so that it can
catch that module's mistakes. It sees every rank's inputs at once (a list
indexed by rank) and returns every rank's outputs.

Legend: see `ubep.layout` (N tokens, H hidden, K top-k, R ranks, E experts, M rows).
"""

from __future__ import annotations

from collections.abc import Sequence
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
        return torch.as_tensor(rank_of_expert, dtype=torch.int64, device=expert.device)[expert]
    return expert // (num_experts // num_ranks)


def local_id_of(expert: torch.Tensor, num_experts: int, num_ranks: int, rank_of_expert=None):
    """Index of each expert among its owner's experts, ascending by expert id."""
    if rank_of_expert is None:
        return expert % (num_experts // num_ranks)
    owners = torch.as_tensor(rank_of_expert, dtype=torch.int64, device=expert.device)
    ids = torch.empty_like(owners)
    for r in range(num_ranks):
        mine = torch.nonzero(owners == r).flatten()
        ids[mine] = torch.arange(mine.numel(), dtype=torch.int64, device=expert.device)
    return ids[expert]


def without_ranks(
    xs: list[torch.Tensor],
    topk_idxs: list[torch.Tensor],
    topk_weights: list[torch.Tensor],
    masked: set[int],
    num_experts: int,
    rank_of_expert=None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Every rank's inputs as a group without `masked` ranks sees them: a masked rank sends no
    token, and each top-k entry that selects a masked rank's expert becomes -1."""
    num_ranks = len(xs)
    out: tuple[list, list, list] = ([], [], [])
    for r in range(num_ranks):
        keep = 0 if r in masked else xs[r].shape[0]
        idx = topk_idxs[r][:keep].clone()
        owners = owner_of(idx.clamp(min=0), num_experts, num_ranks, rank_of_expert)
        for m in masked:
            idx[(idx >= 0) & (owners == m)] = -1
        for part, value in zip(out, (xs[r][:keep], idx, topk_weights[r][:keep]), strict=True):
            part.append(value)
    return out


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
            src_ranks.append(torch.full((int(sent.sum()),), src, dtype=torch.int64, device=idx.device))
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
    outs = [torch.zeros(n, hidden, dtype=torch.float32, device=ys[0].device) for n in num_tokens]
    for expert_rank in range(num_ranks):
        got = dispatched[expert_rank]
        for home in range(num_ranks):
            rows = got.src_rank_M == home
            outs[home].index_add_(0, got.src_token_M[rows], ys[expert_rank][rows].float())
    return [out.to(ys[0].dtype) for out in outs]


# -- low-latency mode ---------------------------------------------------------------------------------


class RefLowLatency(NamedTuple):
    """What one rank receives from a low-latency dispatch; invalid rows are zero / -1.

    Rows of local expert j are [0, recv_count_L[j]), source rank ascending, then
    source token ascending. X is whatever row width the inputs had (H, or H // 128 for scales).
    """

    recv_x_LMX: torch.Tensor  # [L, R * T, X]
    recv_count_L: torch.Tensor  # int32
    src_token_LM: torch.Tensor  # int64, -1 where invalid
    src_rank_LM: torch.Tensor  # int64, -1 where invalid
    src_k_LM: torch.Tensor  # int64, -1 where invalid
    layout_range_LR2: torch.Tensor  # int64 (begin, count) per (local expert, source rank)


def low_latency_dispatch(
    xs: list[torch.Tensor],
    topk_idxs: list[torch.Tensor],
    num_experts: int,
    num_max_tokens: int,
    rank_of_expert=None,
    destinations: Sequence[int] | None = None,
) -> list[RefLowLatency]:
    """Every rank's low-latency dispatch result: one row per (token, selected expert) pair; with
    `destinations`, only those ranks' results, in that order (each holds [L, R * T, H] rows)."""
    R, T = len(xs), num_max_tokens
    L = num_experts // R
    device = xs[0].device
    experts = torch.arange(num_experts, dtype=torch.int64, device=device)
    owners = owner_of(experts, num_experts, R, rank_of_expert)
    local_ids = local_id_of(experts, num_experts, R, rank_of_expert)
    results = []
    for dst in range(R) if destinations is None else destinations:
        recv = torch.zeros(L, R * T, xs[0].shape[1], dtype=xs[0].dtype, device=device)
        info = torch.full((3, L, R * T), -1, dtype=torch.int64, device=device)  # token, rank, k
        ranges = torch.zeros(L, R, 2, dtype=torch.int64, device=device)
        counts = torch.zeros(L, dtype=torch.int32, device=device)
        for j in range(L):
            expert = int(experts[(owners == dst) & (local_ids == j)][0])
            row = 0
            for src in range(R):
                hits = topk_idxs[src] == expert  # [n, K]; at most one hit per row
                tokens = torch.nonzero(hits.any(dim=1)).flatten()
                c = tokens.numel()
                recv[j, row : row + c] = xs[src][tokens]
                info[0, j, row : row + c] = tokens
                info[1, j, row : row + c] = src
                info[2, j, row : row + c] = hits[tokens].int().argmax(dim=1)
                ranges[j, src] = torch.tensor([row, c], dtype=torch.int64, device=device)
                row += c
            counts[j] = row
        results.append(RefLowLatency(recv, counts, info[0], info[1], info[2], ranges))
    return results


def weighted_sum(y_NKH: torch.Tensor, w_NK: torch.Tensor, valid_NK: torch.Tensor) -> torch.Tensor:
    """float32 [N, H]: sum over k ascending of w[n, k] * y[n, k] where valid (others add nothing).

    The one formula every transport's low-latency combine uses, so sums agree bit for bit.
    """
    N, K, H = y_NKH.shape
    y_NKH = y_NKH.to(torch.float32, copy=True)  # the caller's rows are never written
    y_NKH[~valid_NK] = 0.0  # invalid slots may hold anything, NaN included
    w_NK = torch.where(valid_NK, w_NK, 0.0)
    acc_NH = torch.zeros(N, H, dtype=torch.float32, device=y_NKH.device)
    for k in range(K):
        acc_NH += w_NK[:, k, None] * y_NKH[:, k]  # product rounded, then sum rounded: same everywhere
    return acc_NH


def low_latency_combine(
    ys: list[torch.Tensor],
    dispatched: list[RefLowLatency],
    topk_idxs: list[torch.Tensor],
    topk_weights: list[torch.Tensor],
) -> list[torch.Tensor]:
    """Every rank's combined output: sum_k topk_weights[t, k] * y(t, k), in float32, cast to ys' dtype.

    `ys[r]` is rank r's expert output [L, R * T, H], row for row what it received.
    """
    R = len(ys)
    L, _, H = ys[0].shape
    outs = []
    for home in range(R):
        N, K = topk_idxs[home].shape
        y_NKH = torch.zeros(N, K, H, dtype=ys[0].dtype, device=ys[0].device)
        for expert_rank in range(R):
            got = dispatched[expert_rank]
            for j in range(L):
                mine = got.src_rank_LM[j] == home
                y_NKH[got.src_token_LM[j][mine], got.src_k_LM[j][mine]] = ys[expert_rank][j][mine]
        acc = weighted_sum(y_NKH, topk_weights[home], topk_idxs[home] >= 0)
        outs.append(acc.to(ys[0].dtype))
    return outs

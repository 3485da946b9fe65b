"""Routing -> layout: everything dispatch derives from `topk_idx`, as pure torch ops.

Shape legend, one for all of ubep (each letter means one thing):
    N  tokens on this rank            H  hidden size
    K  top-k (experts per token)      E  experts in the EP group
    R  ranks in the EP group          L  local experts per rank (E // R)
    M  rows received by this rank     T  capacity: max tokens per rank and call
    B  bytes of a row                 X  rows of a source region (any count)
    P  (token, expert) pairs          Q  rows sent back to their home
    G  nodes                          V  ranks per node
    F  rows of a forward set          S  rows crossing between nodes
    O  own tokens kept in the node    Y  columns of a partial sum (H or H + K)
    W  workers of a rank              I  pieces of a schedule
    D  destinations (or devices)      C  distance classes of a fabric
    Z  messages of a simulated plan   n  rows of one call's slice (lower case)

A name's suffix gives its shape: `topk_idx_NK` is [N, K], `counts_R` is [R].
No function here loops over tokens in Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ubep import validate


@dataclass(frozen=True, slots=True)
class ExpertPlacement:
    """Which rank owns each expert, and its index among that rank's experts.

    The default (`contiguous`) puts expert e on rank e // L as local expert e % L.
    """

    num_ranks: int
    rank_of_expert_E: torch.Tensor  # int64 [E]
    local_index_E: torch.Tensor  # int64 [E]

    @property
    def num_experts(self) -> int:
        return self.rank_of_expert_E.numel()

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @classmethod
    def contiguous(cls, num_experts: int, num_ranks: int) -> ExpertPlacement:
        if num_experts % num_ranks:
            raise ValueError(
                f"num_experts ({num_experts}) must be a multiple of the group size ({num_ranks})"
            )
        validate.expert_tables(num_experts)  # before the tables below are allocated
        experts_E = torch.arange(num_experts, dtype=torch.int64)
        local = num_experts // num_ranks
        return cls(num_ranks, experts_E // local, experts_E % local)

    @classmethod
    def from_ranks(cls, rank_of_expert: list[int] | torch.Tensor, num_ranks: int) -> ExpertPlacement:
        """An explicit placement: rank_of_expert[e] owns expert e; every rank owns E // R."""
        rank_E = torch.as_tensor(rank_of_expert, dtype=torch.int64).flatten()
        num_experts = rank_E.numel()
        if num_experts % num_ranks:
            raise ValueError(f"expert_placement: {num_experts} experts do not split over {num_ranks} ranks")
        if rank_E.min() < 0 or rank_E.max() >= num_ranks:
            raise ValueError(f"expert_placement: rank ids must lie in [0, {num_ranks})")
        per_rank_R = torch.bincount(rank_E, minlength=num_ranks)
        if (per_rank_R != num_experts // num_ranks).any():
            raise ValueError(
                f"expert_placement: every rank must own {num_experts // num_ranks} experts, "
                f"got {per_rank_R.tolist()}"
            )
        # Local index = rank of the expert among its owner's experts, in expert-id order.
        order_E = torch.argsort(rank_E * num_experts + torch.arange(num_experts), stable=True)
        local_E = torch.empty_like(rank_E)
        local_E[order_E] = torch.arange(num_experts) % (num_experts // num_ranks)
        return cls(num_ranks, rank_E, local_E)


@dataclass(frozen=True, slots=True)
class DispatchLayout:
    """Per-call routing summary of one rank's tokens (DeepEP's get_dispatch_layout)."""

    num_tokens_per_rank_R: torch.Tensor  # int32 [R]: tokens with >= 1 expert on rank r
    num_tokens_per_expert_E: torch.Tensor  # int32 [E]
    is_token_in_rank_NR: torch.Tensor  # bool [N, R]


def token_in_rank(topk_idx_NK: torch.Tensor, placement: ExpertPlacement) -> torch.Tensor:
    """bool [N, R]: whether token n selects at least one expert on rank r.

    Scatters each slot's owner rank into a row of R + 1 columns; "no expert"
    (-1) lands in the extra column, which is dropped.
    """
    R = placement.num_ranks
    owner_NK = placement.rank_of_expert_E[topk_idx_NK.clamp(min=0)]
    owner_NK = torch.where(topk_idx_NK >= 0, owner_NK, R)
    hit_NR1 = torch.zeros(topk_idx_NK.shape[0], R + 1, dtype=torch.bool)
    return hit_NR1.scatter_(1, owner_NK, True)[:, :R].contiguous()  # compiled halves take it as it is


def tokens_per_node(is_token_in_rank_NR: torch.Tensor, node_of_rank: tuple[int, ...]) -> torch.Tensor:
    """int32 [G]: tokens with at least one expert on each node (DeepEP's num_tokens_per_rdma_rank)."""
    node_R = torch.tensor(node_of_rank, dtype=torch.int64)
    G = int(node_R.max()) + 1
    hit_NG = torch.zeros(is_token_in_rank_NR.shape[0], G, dtype=torch.int32)
    hit_NG.index_add_(1, node_R, is_token_in_rank_NR.to(torch.int32))
    return (hit_NG > 0).sum(dim=0, dtype=torch.int32)


def dispatch_layout(topk_idx_NK: torch.Tensor, placement: ExpertPlacement) -> DispatchLayout:
    """Counts and membership for one rank's routing."""
    is_token_in_rank_NR = token_in_rank(topk_idx_NK, placement)
    valid = topk_idx_NK[topk_idx_NK >= 0]
    per_expert_E = torch.bincount(valid, minlength=placement.num_experts)
    return DispatchLayout(
        num_tokens_per_rank_R=is_token_in_rank_NR.sum(dim=0, dtype=torch.int32),
        num_tokens_per_expert_E=per_expert_E.to(torch.int32),
        is_token_in_rank_NR=is_token_in_rank_NR,
    )


def tokens_for_rank(is_token_in_rank_NR: torch.Tensor, rank: int) -> torch.Tensor:
    """int64 [n]: ascending indices of the tokens sent to `rank`."""
    return torch.nonzero(is_token_in_rank_NR[:, rank]).flatten()


def localize_topk(
    topk_idx_nK: torch.Tensor,
    topk_weights_nK: torch.Tensor | None,
    placement: ExpertPlacement,
    rank: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The receiver's view of routing rows: local expert ids on `rank`, -1 elsewhere.

    Weights keep their value where the expert is local and become 0 elsewhere.
    Example (L=2, rank 1 owns experts 2,3): [3, 0, -1] -> [1, -1, -1].
    """
    mine_nK = (topk_idx_nK >= 0) & (placement.rank_of_expert_E[topk_idx_nK.clamp(min=0)] == rank)
    local_nK = placement.local_index_E[topk_idx_nK.clamp(min=0)]
    local_nK = torch.where(mine_nK, local_nK, torch.full_like(local_nK, -1))
    if topk_weights_nK is None:
        return local_nK, None
    return local_nK, torch.where(mine_nK, topk_weights_nK, torch.zeros_like(topk_weights_nK))


def localize_for_destinations(
    topk_idx_nK: torch.Tensor, topk_weights_nK: torch.Tensor, dest_n: torch.Tensor, placement: ExpertPlacement
) -> tuple[torch.Tensor, torch.Tensor]:
    """`localize_topk` for rows bound to different ranks: row i as rank dest_n[i] sees it."""
    safe_nK = topk_idx_nK.clamp(min=0)
    mine_nK = (topk_idx_nK >= 0) & (placement.rank_of_expert_E[safe_nK] == dest_n.unsqueeze(1))
    local_nK = torch.where(mine_nK, placement.local_index_E[safe_nK], -1)
    return local_nK, torch.where(mine_nK, topk_weights_nK, 0.0)


def destination_major(is_token_in_rank_NR: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dest_n, token_n): every (token, destination) pair, sorted by destination then token.

    This is the send order of an all-to-all: rows for rank 0 first, each block ascending.
    """
    dest_n, token_n = torch.nonzero(is_token_in_rank_NR.T, as_tuple=True)
    return dest_n, token_n


def expert_counts(local_idx_MK: torch.Tensor, num_local_experts: int, alignment: int) -> list[int]:
    """Rows per local expert, each rounded up to `alignment` (a Python list of L ints)."""
    valid = local_idx_MK[local_idx_MK >= 0]
    return aligned(torch.bincount(valid, minlength=num_local_experts).numpy(), alignment)


def aligned(counts_L: np.ndarray, alignment: int) -> list[int]:
    """Each count rounded up to a multiple of `alignment`, as a Python list."""
    return ((counts_L + alignment - 1) // alignment * alignment).tolist()


def prefix_offsets(counts_R: torch.Tensor) -> torch.Tensor:
    """int64 [R + 1]: exclusive prefix sum, so block r is rows [off[r], off[r+1])."""
    offsets = torch.zeros(counts_R.numel() + 1, dtype=torch.int64)
    torch.cumsum(counts_R, dim=0, out=offsets[1:])
    return offsets

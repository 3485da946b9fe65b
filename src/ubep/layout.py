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

    def to(self, device: torch.device | str) -> ExpertPlacement:
        """This placement with its tables on `device` (itself if they are there): the layout helpers
        index the tables with topk_idx, so both must live on one device. Copies: build it once."""
        device = torch.device(device)
        if self.rank_of_expert_E.device == device:
            return self
        return ExpertPlacement(
            self.num_ranks, self.rank_of_expert_E.to(device), self.local_index_E.to(device)
        )

    @classmethod
    def given(
        cls, owners: list[int] | torch.Tensor | None, num_experts: int, num_ranks: int
    ) -> ExpertPlacement:
        """A Buffer's `expert_placement` argument (E owner ranks, or None: contiguous blocks), checked
        against its num_experts."""
        placement = (
            cls.contiguous(num_experts, num_ranks) if owners is None else cls.from_ranks(owners, num_ranks)
        )
        if placement.num_experts != num_experts:
            raise ValueError(
                f"expert_placement lists {placement.num_experts} experts, num_experts is {num_experts}"
            )
        return placement

    @classmethod
    def contiguous(cls, num_experts: int, num_ranks: int) -> ExpertPlacement:
        if num_experts % num_ranks:
            raise ValueError(
                f"num_experts ({num_experts}) must be a multiple of the group size ({num_ranks})"
            )
        validate.expert_tables(num_experts)  # before the tables below are allocated
        experts_E = torch.arange(num_experts, dtype=torch.int64, device="cpu")
        local = num_experts // num_ranks
        return cls(num_ranks, experts_E // local, experts_E % local)

    @classmethod
    def from_ranks(cls, rank_of_expert: list[int] | torch.Tensor, num_ranks: int) -> ExpertPlacement:
        """An explicit placement: rank_of_expert[e] owns expert e; every rank owns E // R."""
        rank_E = torch.as_tensor(rank_of_expert, dtype=torch.int64, device="cpu").flatten()
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
        experts_E = torch.arange(num_experts, dtype=torch.int64, device="cpu")
        order_E = torch.argsort(rank_E * num_experts + experts_E, stable=True)
        local_E = torch.empty_like(rank_E)
        local_E[order_E] = experts_E % (num_experts // num_ranks)
        return cls(num_ranks, rank_E, local_E)


@dataclass(frozen=True, slots=True)
class DispatchLayout:
    """Per-call routing summary of one rank's tokens (DeepEP's get_dispatch_layout)."""

    num_tokens_per_rank_R: torch.Tensor  # int32 [R]: tokens with >= 1 expert on rank r
    num_tokens_per_expert_E: torch.Tensor  # int32 [E]
    is_token_in_rank_NR: torch.Tensor  # bool [N, R]


def _owner_rank(topk_idx_NK: torch.Tensor, placement: ExpertPlacement) -> torch.Tensor:
    """int64 [N, K]: the rank that owns each slot's expert; R for "no expert".

    "No expert" is -1, and also any id outside [0, E): callers check values where they read them
    (validation, or a kernel), so the lookup is clamped here and never indexes out of bounds (on a
    GPU that is a device assert). The placement's tables must be on topk_idx's device
    (`ExpertPlacement.to`); nothing is copied and nothing read back.
    """
    rank_E = placement.rank_of_expert_E
    if rank_E.device != topk_idx_NK.device:
        raise ValueError(
            f"topk_idx is on {topk_idx_NK.device}, the expert placement's tables on {rank_E.device}: "
            "pass placement.to(topk_idx.device)"
        )
    E = rank_E.numel()
    valid_NK = (topk_idx_NK >= 0) & (topk_idx_NK < E)
    return torch.where(valid_NK, rank_E[topk_idx_NK.clamp(0, E - 1)], placement.num_ranks)


def token_in_rank(topk_idx_NK: torch.Tensor, placement: ExpertPlacement) -> torch.Tensor:
    """bool [N, R]: whether token n selects at least one expert on rank r.

    Scatters each slot's owner rank into a row of R + 1 columns; "no expert"
    (-1, or an id outside [0, E)) lands in the extra column, which is dropped.
    Runs on topk_idx's device with no host read.
    """
    R = placement.num_ranks
    owner_NK = _owner_rank(topk_idx_NK, placement)
    hit_NR1 = torch.zeros(topk_idx_NK.shape[0], R + 1, dtype=torch.bool, device=topk_idx_NK.device)
    return hit_NR1.scatter_(1, owner_NK, True)[:, :R].contiguous()  # compiled halves take it as it is


def tokens_per_node(is_token_in_rank_NR: torch.Tensor, node_of_rank: tuple[int, ...]) -> torch.Tensor:
    """int32 [G]: tokens with at least one expert on each node (DeepEP's num_tokens_per_rdma_rank).

    Each run of consecutive ranks on one node is a column slice, ORed into its node's column: only
    Python ints index, so no table is copied to the device and nothing is read back.
    """
    G = max(node_of_rank) + 1
    N, R = is_token_in_rank_NR.shape
    hit_NG = torch.zeros(N, G, dtype=torch.bool, device=is_token_in_rank_NR.device)
    start = 0
    for end in range(1, R + 1):
        if end == R or node_of_rank[end] != node_of_rank[start]:
            hit_NG[:, node_of_rank[start]] |= is_token_in_rank_NR[:, start:end].any(dim=1)
            start = end
    return hit_NG.sum(dim=0, dtype=torch.int32)


def dispatch_layout(topk_idx_NK: torch.Tensor, placement: ExpertPlacement) -> DispatchLayout:
    """Counts and membership for one rank's routing, on topk_idx's device with no host read.

    Each (token, slot) pair adds 1 to its expert's bin; "no expert" (-1, or an id outside
    [0, E)) goes to an extra bin E, which is dropped.
    """
    E = placement.num_experts
    is_token_in_rank_NR = token_in_rank(topk_idx_NK, placement)
    valid_NK = (topk_idx_NK >= 0) & (topk_idx_NK < E)
    bin_P = torch.where(valid_NK, topk_idx_NK, E).flatten()
    per_expert_E1 = torch.zeros(E + 1, dtype=torch.int32, device=topk_idx_NK.device)
    per_expert_E1.index_add_(0, bin_P, torch.ones_like(bin_P, dtype=torch.int32))
    return DispatchLayout(
        num_tokens_per_rank_R=is_token_in_rank_NR.sum(dim=0, dtype=torch.int32),
        num_tokens_per_expert_E=per_expert_E1[:E],
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
    if alignment == 1:  # the usual case, on every call: no arithmetic
        return counts_L.tolist()
    return ((counts_L + alignment - 1) // alignment * alignment).tolist()


def prefix_offsets(counts_R: torch.Tensor) -> torch.Tensor:
    """int64 [R + 1]: exclusive prefix sum, so block r is rows [off[r], off[r+1])."""
    offsets = torch.zeros(counts_R.numel() + 1, dtype=torch.int64, device=counts_R.device)
    torch.cumsum(counts_R, dim=0, out=offsets[1:])
    return offsets

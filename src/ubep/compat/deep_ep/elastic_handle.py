"""DeepEP V2's `EPHandle`, and the routing tables ubep keeps beside it.

Legend: R ranks, S source (home) ranks, N home tokens, K top-k lanes, E experts,
L = E // R local experts, M rows this rank received (one per token and receiving
rank), X expanded rows (one per token and local expert, padded per expert),
J = min(K, L) "streams": stream j holds the tokens with more than j lanes on a rank.

`EPHandle` carries DeepEP's named fields, assignable as in DeepEP (its tests slice
`recv_src_metadata` in place). What combine and a cached dispatch rely on lives in
`route`, a frozen `ElasticRoute` no assignment can disturb.

Example, R = 2, L = 2, K = 2, T = 4 (num_max_tokens_per_rank), rank 1 receives
token 3 of rank 0 with topk_idx [3, 0] (expert 3 is rank 1's local expert 1):
recv_src_metadata row = [0 * 4 + 3, 0 * 2 + 0, slot of lane 0, -1] in expand mode
(column 1: source scale-up rank * K + the last lane on this rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ubep.results import DispatchHandle


def align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def lanes_per_rank(topk_idx_NK: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """int64 [N, R]: how many of each token's lanes select an expert of rank r."""
    owner_NK = torch.where(topk_idx_NK >= 0, topk_idx_NK // (num_experts // num_ranks), num_ranks)
    lanes_NR1 = torch.zeros(topk_idx_NK.shape[0], num_ranks + 1, dtype=torch.int64, device=topk_idx_NK.device)
    lanes_NR1.scatter_add_(1, owner_NK, torch.ones_like(owner_NK))
    return lanes_NR1[:, :num_ranks]


def stream_counts(lanes_NR: torch.Tensor, num_streams: int) -> torch.Tensor:
    """int64 [R, J]: tokens with more than j lanes on rank r (j = 0: tokens sent to r)."""
    return (lanes_NR.unsqueeze(2) > torch.arange(num_streams, dtype=torch.int64, device=lanes_NR.device)).sum(
        dim=0
    )


@dataclass(frozen=True, slots=True)
class ElasticRoute:
    """One dispatch's routing, as ubep saw it.

    inner:            ubep's forward handle (rows by source rank, then source token).
    sent_SRJ:         int64 [S, R, J], every rank's `stream_counts` (gathered at dispatch).
    recv_topk_idx_MK: local expert of each received row's lanes, -1 where another rank owns it.
    slot_MK:          expanded row of each local lane, -1 elsewhere (laid out for both modes).
    num_expanded:     valid expanded rows plus padding, sum of aligned per-expert counts.
    """

    inner: DispatchHandle
    sent_SRJ: torch.Tensor
    recv_topk_idx_MK: torch.Tensor
    slot_MK: torch.Tensor
    num_expanded: int

    @property
    def num_recv(self) -> int:
        return self.inner.num_recv_tokens

    @property
    def num_streams(self) -> int:
        return self.sent_SRJ.shape[2]

    def stream_rows(self, j: int) -> torch.Tensor:
        """Received rows (ascending) whose token has more than j lanes here: what stream j sends home."""
        return torch.nonzero((self.recv_topk_idx_MK >= 0).sum(dim=1) > j).flatten()

    def positions(self, me: int, topk_idx_NK: torch.Tensor, num_experts: int, j: int) -> torch.Tensor:
        """int64 [R, P]: token of rank `me` at each position of every rank's stream j (-1: another's)."""
        S, R, _ = self.sent_SRJ.shape
        per_rank_R = self.sent_SRJ[:, :, j].sum(dim=0)
        table_RP = torch.full(
            (R, int(per_rank_R.max()) if R else 0), -1, dtype=torch.int64, device=topk_idx_NK.device
        )
        lanes_NR = lanes_per_rank(topk_idx_NK, num_experts, R)
        before_R = self.sent_SRJ[:me, :, j].sum(dim=0)
        for r in range(R):
            tokens = torch.nonzero(lanes_NR[:, r] > j).flatten()
            table_RP[r, before_R[r] : before_R[r] + tokens.numel()] = tokens
        return table_RP


def expanded_slots(recv_topk_idx_MK: torch.Tensor, num_local_experts: int, alignment: int):
    """(slot_MK, counts_L, starts_L): each local lane's expanded row, grouped by expert, rows ascending.

    Expert e's rows start at starts_L[e], the aligned total of the experts before it.
    Example, alignment 4, counts [3, 1]: expert 0 in rows 0..2, row 3 padding, expert 1 in row 4.
    """
    slot_MK = torch.full_like(recv_topk_idx_MK, -1)
    counts_L = torch.bincount(recv_topk_idx_MK[recv_topk_idx_MK >= 0], minlength=num_local_experts)
    aligned_L = (counts_L + alignment - 1) // alignment * alignment
    starts_L = aligned_L.cumsum(0) - aligned_L
    for e in range(num_local_experts):
        rows, lanes = torch.nonzero(recv_topk_idx_MK == e, as_tuple=True)  # row-major: rows ascending
        slot_MK[rows, lanes] = starts_L[e] + torch.arange(rows.numel(), dtype=torch.int64, device=rows.device)
    return slot_MK, counts_L, starts_L


class EPHandle:
    """DeepEP V2's dispatch handle: its named fields (assignable), ubep's `route` inside.

    do_expand, num_experts, expert_alignment, num_max_tokens_per_rank, num_sms: the call's settings.
    topk_idx: the dispatched top-k (the caller's tensor, or a copy with do_handle_copy).
    psum_num_recv_tokens_per_scaleup_rank: int32 [scale-up ranks], inclusive prefix sum of the
        tokens received from sources with each scale-up index (a token once per rank).
    psum_num_recv_tokens_per_expert: int32 [L]; non-expand: inclusive prefix sum of aligned counts;
        expand: aligned start of expert e plus its real count.
    num_recv_tokens_per_expert_list: aligned counts per local expert ([] without CPU sync).
    num_unaligned_recv_tokens_per_expert: int32 [L], real counts.
    recv_src_metadata: int32 [rows, 2 + K]: source global index (rank * T + token), source
        scale-up rank (hybrid: slot) * K + last local lane, then each lane's expanded row (-1).
    dst_buffer_slot_idx: int32 [N, K]: the row each lane's token lands in on its owner (-1: none).
    token_metadata_at_forward, channel_linked_list: DeepEP's hybrid-kernel internals; None here.
    num_recv_tokens, num_expanded_tokens: rows of the outputs (worst case without CPU sync).
    """

    def __init__(self, route: ElasticRoute, **fields):
        self.route = route
        self.token_metadata_at_forward = None
        self.channel_linked_list = None
        self.cached_recv_src_metadata_before_sort = None
        for name, value in fields.items():
            setattr(self, name, value)

    def __repr__(self) -> str:
        return (
            f"EPHandle(do_expand={self.do_expand}, num_experts={self.num_experts}, "
            f"num_recv_tokens={self.num_recv_tokens}, num_expanded_tokens={self.num_expanded_tokens})"
        )

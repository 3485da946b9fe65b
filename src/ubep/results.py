"""What dispatch and combine return: NamedTuples (they unpack like DeepEP's tuples)
and the frozen handle that carries one dispatch's routing to its combine.

Legend: see `ubep.layout`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ubep.overlap import EventOverlap


@dataclass(frozen=True, slots=True)
class RecvRoute:
    """Where one dispatch's received rows came from, in source-rank-then-token order.

    What every protocol returns for a dispatch, and what its handle keeps:
      src_token_M: each row's token index on its source (int64 [M]).
      prefix_R1:   rows from source s are [prefix[s], prefix[s+1]) (int64 [R + 1]).
      src_rank_M:  each row's source rank (int64 [M]), derived once from prefix_R1.
      relay:       protocol-specific relay tables (the hierarchical exchange's
                   `HierRoute`); None for the other protocols.
    """

    src_token_M: torch.Tensor
    prefix_R1: torch.Tensor
    src_rank_M: torch.Tensor
    relay: object | None = None

    @classmethod
    def of(cls, src_token_M: torch.Tensor, prefix_R1: torch.Tensor, relay: object | None = None) -> RecvRoute:
        counts_R = prefix_R1[1:] - prefix_R1[:-1]
        ranks_R = torch.arange(counts_R.numel(), dtype=torch.int64, device=counts_R.device)
        src_rank_M = torch.repeat_interleave(ranks_R, counts_R)
        return cls(src_token_M, prefix_R1, src_rank_M, relay)

    @property
    def num_rows(self) -> int:
        return int(self.prefix_R1[-1])

    def counts(self) -> torch.Tensor:
        """int64 [R]: rows received from each source rank."""
        return self.prefix_R1[1:] - self.prefix_R1[:-1]


@dataclass(frozen=True, slots=True)
class DispatchHandle:
    """Routing of one normal-mode dispatch, enough to combine it or to repeat it.

    Send side (this rank as token owner):
      is_token_in_rank_NR: which ranks each local token was sent to.
      send_counts_R:       tokens sent to each rank (int64).
    Receive side (this rank as expert owner): `recv`, a `RecvRoute`, whose fields
    also read as recv_src_rank_M, recv_src_token_M, recv_prefix_R1 and route.
    """

    num_tokens: int
    is_token_in_rank_NR: torch.Tensor
    send_counts_R: torch.Tensor
    recv: RecvRoute
    num_recv_tokens_per_expert_list: list[int]
    num_dropped: int = 0  # top-k entries of this rank's tokens dropped: they selected a masked rank's expert
    seq: int = 0  # the dispatch's call number (CallId.seq): every rank's combine must name the same one
    padded_to: int = 0  # num_worst_tokens: the dispatch's outputs had this many rows (0: the rows received)

    @property
    def recv_src_rank_M(self) -> torch.Tensor:
        return self.recv.src_rank_M

    @property
    def recv_src_token_M(self) -> torch.Tensor:
        return self.recv.src_token_M

    @property
    def recv_prefix_R1(self) -> torch.Tensor:
        return self.recv.prefix_R1

    @property
    def route(self) -> object | None:
        return self.recv.relay

    @property
    def num_recv_tokens(self) -> int:
        return self.recv.num_rows

    @property
    def num_ranks(self) -> int:
        return self.send_counts_R.numel()

    def recv_counts(self) -> torch.Tensor:
        """int64 [R]: rows received from each source rank."""
        return self.recv.counts()


class LayoutResult(NamedTuple):
    num_tokens_per_rank: torch.Tensor  # int32 [R]
    num_tokens_per_rdma_rank: torch.Tensor | None  # int32 [nodes]; None on one node
    num_tokens_per_expert: torch.Tensor  # int32 [E]
    is_token_in_rank: torch.Tensor  # bool [N, R]
    event: EventOverlap


class DispatchResult(NamedTuple):
    recv_x: torch.Tensor  # [M, H]
    recv_topk_idx: torch.Tensor | None  # int64 [M, K]; None for a cached dispatch
    recv_topk_weights: torch.Tensor | None  # float32 [M, K]; None for a cached dispatch
    num_recv_tokens_per_expert_list: list[int]
    handle: DispatchHandle
    event: EventOverlap


class CombineResult(NamedTuple):
    combined_x: torch.Tensor  # [N, H]
    combined_topk_weights: torch.Tensor | None  # float32 [N, K]
    event: EventOverlap


@dataclass(frozen=True, slots=True)
class LowLatencyHandle:
    """Routing of one low-latency dispatch, what its combine needs.

    Send side (this rank as token owner):
      num_tokens, topk_idx_NK: the routing dispatched (combine must pass the same).
    Receive side (this rank as expert owner), filled in place by the receive half
    (the hook, event.wait(), or the call itself); rows of local expert j are
    `[0, recv_count_L[j])`, grouped by source rank ascending, then source token ascending:
      recv_count_L:        int32 [L], valid rows per local expert (-1 until received).
      recv_src_token_LM:   int64 [L, R * T], source token index of each row (-1: invalid row).
      recv_src_rank_LM:    int64 [L, R * T], source rank of each row (-1: invalid row).
      recv_src_k_LM:       int64 [L, R * T], which top-k slot of its token the row serves.
      layout_range_LR2:    int64 [L, R, 2], (begin, count) of the rows from each source rank.
    """

    num_tokens: int
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    topk_idx_NK: torch.Tensor
    recv_count_L: torch.Tensor
    recv_src_token_LM: torch.Tensor
    recv_src_rank_LM: torch.Tensor
    recv_src_k_LM: torch.Tensor
    layout_range_LR2: torch.Tensor
    seq: int = 0  # the call number (CallId.seq) of the dispatch that made it: every rank's combine must agree

    @property
    def num_local_experts(self) -> int:
        return self.recv_count_L.numel()

    @property
    def num_ranks(self) -> int:
        return self.layout_range_LR2.shape[1]

    @property
    def received(self) -> bool:
        """Whether the receive half has filled the receive-side fields."""
        return bool((self.recv_count_L >= 0).all())


class LowLatencyDispatchResult(NamedTuple):
    recv_x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # [L, R * T, H]; FP8: (values, scales)
    recv_count: torch.Tensor  # int32 [L]
    handle: LowLatencyHandle
    event: EventOverlap
    hook: Callable[[], None]


class LowLatencyCombineResult(NamedTuple):
    combined_x: torch.Tensor  # [N, H]
    event: EventOverlap
    hook: Callable[[], None]

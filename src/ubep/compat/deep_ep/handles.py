"""DeepEP's handle tuples as views over ubep's frozen handles.

DeepEP code unpacks and indexes its handles; ubep's handles are frozen
dataclasses with named fields. The views here do both: `h[3]`, `a, b, *_ = h`
give DeepEP's tensors, and `h.recv_src_token_M` (any field of the ubep handle)
reads through to ubep's names.

Normal mode, DeepEP's intranode handle (C channels: DeepEP splits each rank's
tokens into C contiguous ranges of ceil(N / C) tokens, C = Config.num_sms // 2):
  rank_prefix_matrix [R, R] int32: [i, j] = tokens ranks 0..i send to rank j.
  channel_prefix_matrix [R, C] int32: [r, c] = this rank's tokens of channels 0..c sent to rank r.
  recv_channel_prefix_matrix [R, C] int32: [s, c] = where channel c of source s starts among s's rows.
  recv_src_idx [M] int32: each received row's token index on its source.
  is_token_in_rank [N, R] bool.
  send_head [N, R] int32: a sent token's position in its channel's stream to r, -1 where not sent.
Low-latency mode: (src_info [L, R * T] int32, layout_range [L, R] int64 = begin << 32 | count,
num_max_dispatch_tokens_per_rank, hidden, num_experts).

Example, N = 4 tokens, C = 2 channels (tokens {0, 1} and {2, 3}), tokens 0, 1, 3
sent to rank r: channel_prefix_matrix[r] = [2, 3], send_head[:, r] = [0, 1, -1, 0].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ubep.results import DispatchHandle, LowLatencyHandle

NORMAL_FIELDS = (
    "rank_prefix_matrix",
    "channel_prefix_matrix",
    "recv_channel_prefix_matrix",
    "recv_src_idx",
    "is_token_in_rank",
    "send_head",
)
LOW_LATENCY_FIELDS = ("src_info", "layout_range", "num_max_dispatch_tokens_per_rank", "hidden", "num_experts")


class _TupleView:
    """Indexes, unpacks and measures like DeepEP's tuple; other names read through to `inner`."""

    __slots__ = ()
    _fields: tuple[str, ...] = ()

    def _as_tuple(self) -> tuple:
        return tuple(getattr(self, name) for name in self._fields)

    def __getitem__(self, index):
        return self._as_tuple()[index]

    def __iter__(self):
        return iter(self._as_tuple())

    def __len__(self) -> int:
        return len(self._fields)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (copying, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


@dataclass(frozen=True, slots=True, eq=False)
class NormalHandle(_TupleView):
    """A normal-mode dispatch's handle: DeepEP's 6-tuple, ubep's `DispatchHandle` inside.

    `num_rows` is the row count of the dispatch's outputs: the rows received, or
    `num_worst_tokens` when the outputs were padded to it.
    """

    _fields = NORMAL_FIELDS
    inner: DispatchHandle
    num_experts: int
    num_rows: int
    rank_prefix_matrix: torch.Tensor
    channel_prefix_matrix: torch.Tensor
    recv_channel_prefix_matrix: torch.Tensor
    recv_src_idx: torch.Tensor
    is_token_in_rank: torch.Tensor
    send_head: torch.Tensor


@dataclass(frozen=True, slots=True, eq=False)
class LowLatencyView(_TupleView):
    """A low-latency dispatch's handle: DeepEP's 5-tuple, ubep's `LowLatencyHandle` inside.

    The receive half fills ubep's handle in place, so the DeepEP tensors are read
    from it when asked for (after the hook or the event, as in DeepEP).
    """

    _fields = LOW_LATENCY_FIELDS
    inner: LowLatencyHandle

    @property
    def src_info(self) -> torch.Tensor:
        return self.inner.recv_src_token_LM.to(torch.int32)

    @property
    def layout_range(self) -> torch.Tensor:
        begin_LR, count_LR = self.inner.layout_range_LR2.unbind(dim=2)
        return (begin_LR.clamp_min(0) << 32) | count_LR.clamp_min(0)

    @property
    def num_max_dispatch_tokens_per_rank(self) -> int:
        return self.inner.num_max_dispatch_tokens_per_rank

    @property
    def hidden(self) -> int:
        return self.inner.hidden

    @property
    def num_experts(self) -> int:
        return self.inner.num_experts


def channel_of(tokens: torch.Tensor, num_tokens: int, num_channels: int) -> torch.Tensor:
    """DeepEP's channel of each token index: ranges of ceil(N / C) tokens."""
    per_channel = max(1, -(-num_tokens // num_channels))
    return tokens // per_channel


def normal_handle(
    inner: DispatchHandle,
    counts_RX: torch.Tensor,
    num_channels: int,
    num_experts: int,
    num_rows: int,
) -> NormalHandle:
    """DeepEP's view of `inner`; counts_RX[s] = (tokens s sends to each rank [R], its per-expert counts [E],
    its token count), gathered from every rank."""
    R, N, C = inner.num_ranks, inner.num_tokens, num_channels
    sent_NR = inner.is_token_in_rank_NR
    channel_N = channel_of(torch.arange(N, dtype=torch.int64, device=sent_NR.device), N, C)
    per_channel_CR = torch.zeros(C, R, dtype=torch.int64, device=sent_NR.device).index_add_(
        0, channel_N, sent_NR.long()
    )
    channel_prefix_RC = per_channel_CR.cumsum(dim=0).T
    before_NR = sent_NR.long().cumsum(dim=0) - sent_NR.long()  # sent tokens before each token, per rank
    channel_start_RC = channel_prefix_RC - per_channel_CR.T
    send_head_NR = torch.where(sent_NR, before_NR - channel_start_RC[:, channel_N].T, -1)
    recv_channel_RC = _recv_channel_starts(inner, counts_RX[:, -1], C)
    recv_src_idx_M = torch.full((num_rows,), -1, dtype=torch.int32, device=inner.recv_src_token_M.device)
    recv_src_idx_M[: inner.num_recv_tokens] = inner.recv_src_token_M.to(torch.int32)
    return NormalHandle(
        inner=inner,
        num_experts=num_experts,
        num_rows=num_rows,
        rank_prefix_matrix=counts_RX[:, :R].cumsum(dim=0).to(torch.int32),
        channel_prefix_matrix=channel_prefix_RC.to(torch.int32).contiguous(),
        recv_channel_prefix_matrix=recv_channel_RC,
        recv_src_idx=recv_src_idx_M,
        is_token_in_rank=sent_NR,
        send_head=send_head_NR.to(torch.int32),
    )


def _recv_channel_starts(inner: DispatchHandle, tokens_R: torch.Tensor, num_channels: int) -> torch.Tensor:
    """int32 [R, C]: where each source's channel c starts among the rows this rank got from it."""
    R, C = inner.num_ranks, num_channels
    src_R = inner.recv_src_rank_M
    per_channel = (tokens_R.clamp_min(1) + C - 1) // C  # ceil(N_s / C), per source
    channel_M = inner.recv_src_token_M // per_channel[src_R]
    counts_RC = (
        torch.zeros(R * C, dtype=torch.int64, device=src_R.device)
        .index_add_(0, src_R * C + channel_M, torch.ones_like(channel_M))
        .view(R, C)
    )
    return (counts_RC.cumsum(dim=1) - counts_RC).to(torch.int32)

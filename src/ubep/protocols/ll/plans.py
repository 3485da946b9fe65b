"""Low-latency mode, shared by every transport: plans, output tensors, row placement.

Low-latency dispatch sends one row per (token, selected expert) pair, and the
receiver keeps them expert-major in fixed-shape tensors `[L, R * T, ...]`.
Everything here is pure torch over this rank's own data; transports only move
the rows. Rows travel as bytes (`uint8 [n, B]`), so bf16, fp32 and FP8 pairs
(values then scales, see `ubep.fp8`) all take the same path.

Legend: see `ubep.layout` (N tokens, H hidden, K top-k, R ranks, E experts,
L local experts, T capacity); P counts (token, expert) pairs, Q rows sent back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ubep import fp8
from ubep.engine import Engine
from ubep.engine.torch_engine import as_words
from ubep.layout import ExpertPlacement, prefix_offsets
from ubep.protocols.base import CODE_DTYPES, DTYPE_CODES, Sizing
from ubep.results import LowLatencyHandle

Payload = torch.Tensor | tuple[torch.Tensor, torch.Tensor]

# The two data-as-flag forms of rows (docs/device.md): rows, then a released stamp that covers them;
# or 8-byte words of 4 payload bytes and the epoch, each its own flag (the Triton halves only).
AFTER_DATA, IN_WORD = "after-data", "in-word"
FLAGS = (AFTER_DATA, IN_WORD)


def per_writer(s: Sizing) -> int:
    """The most rows one expert rank returns to one home: each of T tokens selects at most
    min(max_topk, L) of its experts (no expert twice in a row)."""
    return s.capacity * min(s.max_topk, s.placement.num_local_experts)


def gather_rows(rows_NB: torch.Tensor, index_n: torch.Tensor) -> torch.Tensor:
    """uint8 [n, B]: rows_NB[index_n], copied word by word."""
    (words_NW,) = as_words(rows_NB)
    return torch.index_select(words_NW, 0, index_n).view(torch.uint8)


@dataclass(frozen=True, slots=True)
class LLDispatchPlan:
    """The sender's side of one low-latency dispatch; pairs sorted by (destination, local expert, token)."""

    max_tokens: int  # T of this call
    code: int  # wire dtype code (float8 for FP8 pairs)
    rows_NB: torch.Tensor  # uint8 [N, B]: this rank's tokens in wire form
    pair_token_P: torch.Tensor  # int64
    pair_k_P: torch.Tensor  # int64: which top-k slot selected the expert
    pair_local_P: torch.Tensor  # int64: local expert id on the destination
    counts_RL: torch.Tensor  # int64 [R, L]: pairs per (destination, local expert)

    def to(self, dst: int) -> slice:
        """The pairs bound for rank `dst`, as a slice of the pair arrays."""
        offsets = prefix_offsets(self.counts_RL.sum(dim=1))
        return slice(int(offsets[dst]), int(offsets[dst + 1]))


@dataclass(frozen=True, slots=True)
class WireRows:
    """A low-latency dispatch's rows alone: what the device halves take (their kernels find every row's
    destinations from topk_idx on the device; ordering the pairs here would read counts on the host)."""

    max_tokens: int  # T of this call
    code: int  # wire dtype code (float8 for FP8 pairs)
    rows_NB: torch.Tensor  # uint8 [N, B]: this rank's tokens in wire form


def wire_rows(x: Payload, max_tokens: int, use_fp8: bool) -> WireRows:
    """Pack x into wire rows, quantising when asked (tensor operations only: nothing read back)."""
    return WireRows(max_tokens, *_packed(x, use_fp8))


def _packed(x: Payload, use_fp8: bool) -> tuple[int, torch.Tensor]:
    """(wire dtype code, uint8 [N, B] rows) of x, quantised when asked."""
    if use_fp8:
        x = fp8.quantize(x)
    if isinstance(x, tuple | list) and len(x) == 2:  # fp8.is_pair, without a call on the hot path
        return DTYPE_CODES[fp8.VALUE_DTYPE], fp8.to_rows(*x)
    return DTYPE_CODES[x.dtype], x.contiguous().view(torch.uint8)


def dispatch_plan(
    x: Payload,
    topk_idx_NK: torch.Tensor,
    placement: ExpertPlacement,
    max_tokens: int,
    use_fp8: bool,
    engine: Engine | None = None,
) -> LLDispatchPlan:
    """Pack x into wire rows (quantising when asked) and order the (token, expert) pairs: in one
    compiled pass that also checks topk_idx's values where `engine` has one (`Engine.ll_pairs`)."""
    code, rows_NB = _packed(x, use_fp8)
    if engine is not None and engine.ll_pairs is not None:
        R = placement.num_ranks
        pairs = engine.ll_pairs(topk_idx_NK, placement.rank_of_expert_E, placement.local_index_E, R)
        return LLDispatchPlan(max_tokens, code, rows_NB, *pairs)
    N = topk_idx_NK.shape[0]
    R, L = placement.num_ranks, placement.num_local_experts
    token_P, k_P = torch.nonzero(topk_idx_NK >= 0, as_tuple=True)
    expert_P = topk_idx_NK[token_P, k_P]
    rank_of_E, local_of_E = placement.rank_of_expert_E, placement.local_index_E
    if topk_idx_NK.is_cuda:  # the placement's tables live on the CPU
        rank_of_E, local_of_E = rank_of_E.to(topk_idx_NK.device), local_of_E.to(topk_idx_NK.device)
    bucket_P = rank_of_E[expert_P] * L + local_of_E[expert_P]
    order_P = torch.argsort(bucket_P * max(N, 1) + token_P, stable=True)
    counts_RL = torch.bincount(bucket_P, minlength=R * L).view(R, L)
    return LLDispatchPlan(
        max_tokens,
        code,
        rows_NB,
        token_P[order_P],
        k_P[order_P],
        local_of_E[expert_P[order_P]],
        counts_RL,
    )


@dataclass(frozen=True, slots=True)
class LLDispatchOut:
    """The receiver's output tensors, filled in place by the receive half."""

    code: int  # wire dtype code the rows must carry
    recv_x: Payload  # [L, R * T, H] or (values, scales)
    planes: tuple[tuple[torch.Tensor, int, int], ...]  # (uint8 view [L, R * T, b], lo, hi) per tensor
    handle: LowLatencyHandle
    # int32 [L]: the caller's recv_count, a tensor of its own (`received` fills it from the handle's):
    # what the caller writes into it cannot change the handle a later combine reads
    recv_count_L: torch.Tensor

    @property
    def row_width(self) -> int:
        return self.planes[-1][2]


def dispatch_outputs(
    plan: LLDispatchPlan | WireRows,
    hidden: int,
    num_ranks: int,
    topk_idx_NK: torch.Tensor,
    num_experts: int,
    seq: int = 0,
    empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
) -> LLDispatchOut:
    """Allocate recv_x (rows uninitialised), the handle (-1 until received), the caller's recv_count
    (-1 until received) and byte views of recv_x, on topk_idx's device; recv_x by `empty(shape,
    dtype)` where given (`ubep.recycle`: host memory no earlier result holds any more)."""
    L, M, dev = num_experts // num_ranks, num_ranks * plan.max_tokens, topk_idx_NK.device
    if empty is None:

        def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, device=dev)

    if plan.code == DTYPE_CODES[fp8.VALUE_DTYPE]:
        values = empty((L, M, hidden), fp8.VALUE_DTYPE)
        scales = empty((L, M, hidden // fp8.BLOCK), fp8.SCALE_DTYPE)
        recv_x: Payload = (values, scales)
        tensors = (values, scales)
    else:
        recv_x = empty((L, M, hidden), CODE_DTYPES[plan.code])
        tensors = (recv_x,)
    planes, lo = [], 0
    for t in tensors:
        plane = t.view(torch.uint8)  # [L, M, bytes per row]
        planes.append((plane, lo, lo + plane.shape[2]))
        lo += plane.shape[2]
    info = torch.full((3, L, M), -1, dtype=torch.int64, device=dev)
    handle = LowLatencyHandle(
        num_tokens=topk_idx_NK.shape[0],
        num_max_dispatch_tokens_per_rank=plan.max_tokens,
        hidden=hidden,
        num_experts=num_experts,
        topk_idx_NK=topk_idx_NK,
        recv_count_L=torch.full((L,), -1, dtype=torch.int32, device=dev),
        recv_src_token_LM=info[0],
        recv_src_rank_LM=info[1],
        recv_src_k_LM=info[2],
        layout_range_LR2=torch.zeros(L, num_ranks, 2, dtype=torch.int64, device=dev),
        seq=seq,
    )
    return LLDispatchOut(plan.code, recv_x, tuple(planes), handle, handle.recv_count_L.clone())


def received(out: LLDispatchOut, receive: Callable[[], None]) -> Callable[[], None]:
    """The receive half `receive` of a dispatch into `out`, then the handle's recv_count copied into the
    caller's (every transport's halves fill the handle's; a copy on the device where it lives there)."""

    def run() -> None:
        receive()
        out.recv_count_L.copy_(out.handle.recv_count_L)

    return run


def slot_positions(counts_L: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows ordered by local expert: (local expert, index within that expert's run) of each.

    Example: counts [2, 0, 1] -> local [0, 0, 2], index [0, 1, 0].
    """
    local_n = torch.repeat_interleave(
        torch.arange(counts_L.numel(), dtype=torch.int64, device=counts_L.device), counts_L
    )
    index_n = (
        torch.arange(local_n.numel(), dtype=torch.int64, device=counts_L.device)
        - prefix_offsets(counts_L)[:-1][local_n]
    )
    return local_n, index_n


def place_source(
    engine: Engine,
    out: LLDispatchOut,
    src: int,
    begin_L: torch.Tensor,
    counts_L: torch.Tensor,
    rows_nB: torch.Tensor,
    token_n: torch.Tensor,
    k_n: torch.Tensor,
) -> None:
    """Write source `src`'s rows (ordered by local expert, then token) into their final places.

    Example (L=2, counts [2, 1], begin [3, 0]): rows go to (0, 3), (0, 4), (1, 0).
    """
    local_n, index_n = slot_positions(counts_L)
    pos_n = begin_L[local_n] + index_n
    slot_n = local_n * out.planes[0][0].shape[1] + pos_n
    for plane, lo, hi in out.planes:
        engine.copy_rows(rows_nB[:, lo:hi], None, plane.view(-1, hi - lo), slot_n)
    h = out.handle
    h.recv_src_token_LM[local_n, pos_n] = token_n
    h.recv_src_rank_LM[local_n, pos_n] = src
    h.recv_src_k_LM[local_n, pos_n] = k_n
    h.layout_range_LR2[:, src, 0] = begin_L
    h.layout_range_LR2[:, src, 1] = counts_L


def place_all(
    engine: Engine,
    out: LLDispatchOut,
    counts_SL: torch.Tensor,
    rows_MB: torch.Tensor,
    token_M: torch.Tensor,
    k_M: torch.Tensor,
) -> None:
    """Place rows that arrived source-major (then local expert, then token), and set recv_count."""
    begin_L = torch.zeros(counts_SL.shape[1], dtype=torch.int64, device=counts_SL.device)
    offsets = prefix_offsets(counts_SL.sum(dim=1))
    for src in range(counts_SL.shape[0]):
        a, b = int(offsets[src]), int(offsets[src + 1])
        place_source(engine, out, src, begin_L, counts_SL[src], rows_MB[a:b], token_M[a:b], k_M[a:b])
        begin_L = begin_L + counts_SL[src]
    out.handle.recv_count_L.copy_(begin_L)


@dataclass(frozen=True, slots=True)
class LLCombinePlan:
    """Both sides of one low-latency combine.

    Expert side: the rows to send back, ordered by (home rank, local expert, row).
    Home side: the routing to reduce with, and how many rows each expert rank returns.
    """

    code: int
    x_LMB: torch.Tensor  # uint8 view of the expert outputs
    local_Q: torch.Tensor  # int64: the local expert of each row sent back
    row_Q: torch.Tensor  # int64: its row there
    send_counts_R: torch.Tensor  # int64 [R]: rows sent back to each home
    topk_weights_NK: torch.Tensor
    owner_NK: torch.Tensor  # rank owning each selected expert (-1 where none)
    local_NK: torch.Tensor  # its local id there (-1 where none)
    valid_NK: torch.Tensor  # bool: whether a slot selects an expert
    expected_R: torch.Tensor  # int64 [R]: rows each expert rank returns to this rank
    num_local_experts: int
    handle_seq: int = 0  # the call number of the dispatch whose handle this combine uses
    handle: LowLatencyHandle | None = None  # that handle (device halves read its layout themselves)

    def to(self, home: int) -> slice:
        """The rows bound for rank `home`, as a slice of the row arrays."""
        offsets = prefix_offsets(self.send_counts_R)
        return slice(int(offsets[home]), int(offsets[home + 1]))

    def expected_from(self, expert_rank: int) -> int:
        """Rows this rank (as home) gets back from `expert_rank`."""
        return int(self.expected_R[expert_rank])


def combine_plan(
    x_LMH: torch.Tensor,
    topk_weights_NK: torch.Tensor,
    handle: LowLatencyHandle,
    placement: ExpertPlacement,
    engine: Engine | None = None,
) -> LLCombinePlan:
    """Which received rows go back where, and the home side's view of its own routing: in compiled
    passes that also check the handle's topk_idx values where `engine` has them (`Engine.ll_owners`,
    `Engine.ll_returns`)."""
    idx_NK, R = handle.topk_idx_NK, handle.num_ranks
    if engine is not None and engine.ll_owners is not None and engine.ll_returns is not None:
        rows = engine.ll_returns(handle.recv_count_L, handle.recv_src_rank_LM, R)
        home = engine.ll_owners(idx_NK, placement.rank_of_expert_E, placement.local_index_E, R)
    else:
        rows, home = _returns(handle), _owners(idx_NK, placement)
    return LLCombinePlan(
        DTYPE_CODES[x_LMH.dtype],
        x_LMH.contiguous().view(torch.uint8),
        *rows,
        topk_weights_NK,
        *home,
        num_local_experts=handle.num_local_experts,
        handle_seq=handle.seq,
        handle=handle,
    )


def _returns(handle: LowLatencyHandle) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(local_Q, row_Q, counts_R): the received rows ordered by (home rank, local expert, row)."""
    M = handle.recv_src_rank_LM.shape[1]
    valid_LM = torch.arange(
        M, dtype=torch.int64, device=handle.recv_count_L.device
    ) < handle.recv_count_L.long().unsqueeze(1)
    local_Q, row_Q = torch.nonzero(valid_LM, as_tuple=True)  # sorted by (local expert, row)
    home_Q = handle.recv_src_rank_LM[local_Q, row_Q]
    order_Q = torch.argsort(home_Q, stable=True)
    return local_Q[order_Q], row_Q[order_Q], torch.bincount(home_Q, minlength=handle.num_ranks)


def _owners(idx_NK: torch.Tensor, placement: ExpertPlacement) -> tuple[torch.Tensor, ...]:
    """(owner_NK, local_NK, valid_NK, expected_R): each selected expert's rank and local id (-1 where
    none), whether one is, and the rows each rank returns."""
    valid_NK = idx_NK >= 0
    safe_NK = idx_NK.clamp(min=0)
    rank_of_E, local_of_E = placement.rank_of_expert_E, placement.local_index_E
    if idx_NK.is_cuda:  # the placement's tables live on the CPU
        rank_of_E, local_of_E = rank_of_E.to(idx_NK.device), local_of_E.to(idx_NK.device)
    owner_NK = torch.where(valid_NK, rank_of_E[safe_NK], -1)
    expected_R = torch.bincount(owner_NK[valid_NK], minlength=placement.num_ranks)
    return owner_NK, torch.where(valid_NK, local_of_E[safe_NK], -1), valid_NK, expected_R


def home_order(plan: LLCombinePlan) -> tuple[torch.Tensor, torch.Tensor]:
    """The home's (token, k) pairs in the order rows come back: expert rank, local expert, token."""
    token_P, k_P = torch.nonzero(plan.valid_NK, as_tuple=True)
    N, L = plan.valid_NK.shape[0], plan.num_local_experts
    key_P = (plan.owner_NK[token_P, k_P] * L + plan.local_NK[token_P, k_P]) * max(N, 1) + token_P
    order_P = torch.argsort(key_P)
    return token_P[order_P], k_P[order_P]


def reduce_returned(engine: Engine, plan: LLCombinePlan, rows_PB: torch.Tensor, out_NH: torch.Tensor) -> None:
    """Reduce rows that came back in `home_order`."""
    N, K = plan.valid_NK.shape
    token_P, k_P = home_order(plan)
    y_NKB = torch.zeros(N * K, plan.x_LMB.shape[2], dtype=torch.uint8, device=rows_PB.device)
    y_w, rows_w = as_words(y_NKB, rows_PB)
    y_w[token_P * K + k_P] = rows_w
    reduce_rows(engine, plan, y_NKB.view(N, K, y_NKB.shape[1]), out_NH)


def returned_rows(plan: LLCombinePlan, rows: slice | None = None) -> torch.Tensor:
    """uint8 [Q, B]: the expert outputs to send back (all, or one home's slice), word by word."""
    rows = rows or slice(None)
    (x_w,) = as_words(plan.x_LMB)
    return x_w[plan.local_Q[rows], plan.row_Q[rows]].view(torch.uint8)


def reduce_rows(engine: Engine, plan: LLCombinePlan, y_NKB: torch.Tensor, out_NH: torch.Tensor) -> None:
    """out = sum_k w[t, k] * y(t, k) over valid k (float32, k ascending), cast into out's dtype."""
    y_NKH = y_NKB.view(CODE_DTYPES[plan.code])  # [N, K, H]
    out_NH.copy_(engine.weighted_sum(y_NKH, plan.topk_weights_NK, plan.valid_NK))

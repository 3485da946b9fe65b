"""One call's arguments, checked and turned into what its exchange sends: the floor under `Buffer`.

    Buffer.dispatch(x, topk_idx, ...)  -> [Planner.dispatch]  -> SendPlan       -> exchange.dispatch
    Buffer.combine(y, handle)          -> [Planner.combine]   -> rows, weights   -> exchange.combine
    Buffer.low_latency_dispatch(...)   -> [Planner.ll_dispatch] -> LL plan, outputs -> dispatch_send
    Buffer.low_latency_combine(...)    -> [Planner.ll_combine]  -> LL plan (or rows) -> combine_send

Shapes, dtypes and devices are checked here, on the rank that holds them, before anything is sent;
values too, except where a kernel checks them itself (the engine's compiled route, the Triton
halves' send kernels), so that the host reads nothing it need not. Top-k entries of masked ranks'
experts are dropped here (`ubep.membership`), logical ids mapped to slots (`ubep.placement.slots`).

Legend: see `ubep.layout`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ubep import validate
from ubep.engine import Engine
from ubep.layout import aligned, expert_counts, token_in_rank
from ubep.membership import Membership
from ubep.placement.slots import PlacedSlots
from ubep.protocols.base import Received, SendPlan, Sizing
from ubep.protocols.ll.plans import (
    LLCombinePlan,
    LLDispatchOut,
    LLDispatchPlan,
    WireRows,
    combine_plan,
    dispatch_outputs,
    dispatch_plan,
    wire_rows,
)
from ubep.recycle import Recycler
from ubep.results import DispatchHandle, LowLatencyHandle

Payload = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
Route = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # the engine's compiled check-and-layout


@dataclass(frozen=True, kw_only=True, slots=True)
class LLCombineInputs:
    """A low-latency combine's checked inputs: x [L, R * T, H], topk_idx and weights [N, K], `out`
    [N, H], and the host-built plan (None on the device halves, whose send kernel plans)."""

    x: torch.Tensor
    topk_idx_NK: torch.Tensor
    topk_weights_NK: torch.Tensor
    out_NH: torch.Tensor
    plan: LLCombinePlan | None


class Planner:
    """What a Buffer knows for planning its calls, fixed at construction; membership and placement
    change between calls and are read at each (guarded inline: the common call has neither)."""

    def __init__(
        self,
        sizing: Sizing,
        device: torch.device,
        *,
        route: Route | None,
        engine: Engine | None = None,
        layout_by_send: bool,
        capturable: bool,
        membership: Membership,
        slots: PlacedSlots,
    ):
        self.sizing, self.device, self.num_ranks = sizing, device, sizing.num_ranks
        self.route = route  # the engine's compiled check-and-layout, where it has one
        # the engine whose compiled low-latency plans check the values (`Engine.ll_pairs`), or None
        self.ll_engine = engine if engine is not None and engine.ll_pairs is not None else None
        self.layout_by_send = layout_by_send  # the exchange's send kernel derives the layout (Triton)
        self.capturable = capturable  # no host reads at all: the kernels check values, counts not taken
        self.membership, self.slots = membership, slots
        self.num_experts = sizing.placement.num_experts
        self.num_local_experts = sizing.placement.num_local_experts
        self.max_recv = sizing.capacity * self.num_ranks  # the most rows a rank receives in one dispatch
        self.rank_of_expert_E = sizing.placement.rank_of_expert_E.numpy()  # for the compiled route
        self.device_placement = sizing.placement.to(device)  # its tables where the caller's topk_idx lives
        # low-latency recv_x in host memory that no earlier result holds any more (`ubep.recycle`)
        self.recycler = Recycler() if device.type == "cpu" else None

    # -- normal mode ------------------------------------------------------------------------------

    def dispatch(
        self,
        x: Payload,
        handle,
        num_tokens_per_rank,
        is_token_in_rank,
        topk_idx,
        topk_weights,
        num_worst: int,
    ) -> tuple[SendPlan, int]:
        """The plan, and how many top-k entries it dropped (they select a masked rank's experts)."""
        if handle is not None:
            self.check_handle(handle)
            self.slots.check_handle(handle.seq)
            self.membership.check_cached(handle)
            x, scales = self.payload(x, rows=handle.num_tokens)
            plan = SendPlan(x, None, None, handle.is_token_in_rank_NR, handle.send_counts_R, scales)
            return plan, handle.num_dropped
        if topk_idx is None or topk_weights is None:
            raise ValueError("dispatch needs topk_idx and topk_weights unless a handle is given")
        x, scales = self.payload(x)
        if self.slots.copy_map is not None:
            topk_idx = self.slots.physical(topk_idx)
        if self.layout_by_send:
            plan, dropped = self._by_send(
                x, scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank
            )
        else:
            plan, dropped = self._on_host(
                x, scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank
            )
        if num_worst:
            validate.positive("num_worst_tokens", num_worst)
            plan = replace(plan, num_worst_tokens=num_worst)
        return plan, dropped

    def _on_host(
        self, x, scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank
    ) -> tuple[SendPlan, int]:
        """The layout derived here: by the engine's compiled route (which checks the values too), else
        in torch after checking the values."""
        masked = self.membership.masked
        route = None if masked else self.route
        idx = validate.topk_idx(
            topk_idx,
            x.shape[0],
            self.num_experts,
            self.sizing.max_topk,
            values=route is None,
            device=self.device,
        )
        w = validate.topk_weights(topk_weights, tuple(idx.shape), device=self.device)
        if route is not None:
            is_token_in_rank_NR, counts_R = route(idx, self.rank_of_expert_E, self.num_ranks)
            dropped = 0
        else:
            idx, dropped = self.membership.drop(idx) if masked else (idx, 0)
            is_token_in_rank_NR = token_in_rank(idx, self.device_placement)  # no per-expert counts needed
            counts_R = is_token_in_rank_NR.sum(dim=0)
        if num_tokens_per_rank is not None or is_token_in_rank is not None:
            validate.layout_args(num_tokens_per_rank, is_token_in_rank, is_token_in_rank_NR, self.device)
        return SendPlan(x, idx, w, is_token_in_rank_NR, counts_R, scales), dropped

    def _by_send(
        self, x, scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank
    ) -> tuple[SendPlan, int]:
        """For Triton halves that derive the layout and check topk_idx's values in their send kernel:
        shapes, dtypes and devices checked here, no value read (-1 dropped entries: not counted with
        `capturable`, where counting would read back)."""
        N, R = x.shape[0], self.num_ranks
        idx = validate.topk_idx(
            topk_idx, N, self.num_experts, self.sizing.max_topk, values=False, device=self.device
        )
        w = validate.topk_weights(topk_weights, tuple(idx.shape), device=self.device)
        dropped = 0
        if self.membership.masked:
            idx, dropped = self.membership.drop(idx, count=not self.capturable)
            dropped = -1 if self.capturable else dropped
        if num_tokens_per_rank is not None or is_token_in_rank is not None:
            validate.layout_shapes(num_tokens_per_rank, is_token_in_rank, N, R, self.device)
        # zeroed: a call whose input the kernel rejects leaves a handle that routes nothing
        in_rank_NR = torch.zeros(N, R, dtype=torch.bool, device=self.device)
        counts_R = torch.zeros(R, dtype=torch.int64, device=self.device)
        return SendPlan(x, idx, w, in_rank_NR, counts_R, scales, layout_by_send=True), dropped

    def handle(
        self, plan: SendPlan, got: Received, dropped: int, seq: int, worst: int, expert_alignment: int
    ) -> DispatchHandle:
        """The handle of a fresh dispatch: its routing, what it received, and the rows per local expert
        rounded up to `expert_alignment` (none with `worst` padding, as DeepEP: counting would read
        the received rows on the host)."""
        if worst:
            counts = []
        elif got.rows_per_expert_L is None:
            counts = expert_counts(got.recv_topk_idx_MK, self.num_local_experts, expert_alignment)
        else:
            counts = aligned(got.rows_per_expert_L, expert_alignment)
        return DispatchHandle(
            num_tokens=plan.x_NH.shape[0],
            is_token_in_rank_NR=plan.is_token_in_rank_NR,
            send_counts_R=plan.send_counts_R,
            recv=got.route,
            num_recv_tokens_per_expert_list=counts,
            num_dropped=dropped,
            seq=seq,
            padded_to=worst,
        )

    def check_handle(self, handle) -> None:
        """A normal-mode handle of this Buffer, made after the latest mask."""
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"handle must come from Buffer.dispatch, got {type(handle).__name__}")
        if handle.send_counts_R.numel() != self.num_ranks:
            raise ValueError(f"handle is for {handle.num_ranks} ranks, this Buffer has {self.num_ranks}")
        if handle.seq <= self.membership.stale_after:
            self.membership.check_handle(handle.seq)

    def payload(self, x, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(x, None), or an FP8 pair's (values, scales), validated."""
        s = self.sizing
        if isinstance(x, tuple | list) and len(x) == 2:  # fp8.is_pair, without a call on the hot path
            return validate.fp8_pair("x", x, s.hidden, s.capacity, rows=rows, device=self.device)
        return validate.payload("x", x, s.hidden, s.capacity, rows=rows, device=self.device), None

    def combine(
        self, x: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, DispatchHandle]:
        """(rows, weights) a combine sends back: the rows received, not a padded dispatch's padding;
        and the handle to combine with, its sends to ranks masked since its dispatch left out."""
        self.check_handle(handle)
        handle = self.membership.around(handle)
        M = handle.padded_to or handle.recv.num_rows
        x = validate.payload("x", x, self.sizing.hidden, max(M, self.max_recv), M, self.device)
        if topk_weights is not None:
            topk_weights = validate.combine_weights(topk_weights, M, self.sizing.max_topk, self.device)
        if handle.padded_to:  # the rows received go back, not the padding (a device route has it)
            routed = handle.recv.src_token_M.shape[0]
            x, topk_weights = x[:routed], None if topk_weights is None else topk_weights[:routed]
        return x, topk_weights, handle

    # -- low-latency mode -------------------------------------------------------------------------

    def ll_dispatch(
        self, x, topk_idx, max_tokens: int, num_experts: int, use_fp8: bool, routed: bool, seq: int
    ) -> tuple[LLDispatchPlan | WireRows, LLDispatchOut]:
        """The send plan (`routed`: the rows on the wire alone, the halves route them and check the
        values) and the outputs its receive half fills."""
        s = self.sizing
        if num_experts != self.num_experts or self.slots.placement is not None:  # else it holds
            self.slots.check_num_experts(num_experts)
        x = validate.low_latency_x(x, s.hidden, max_tokens, s.capacity, use_fp8, self.device)
        if self.slots.copy_map is not None:
            topk_idx = self.slots.physical(topk_idx)
        # routed, the send half checks the values; else the engine's compiled plan, where it has one
        compiled = None if routed or self.membership.masked else self.ll_engine
        values = not routed and compiled is None
        idx = validate.topk_idx(topk_idx, x.shape[0], self.num_experts, s.max_topk, values, self.device)
        if self.membership.masked:
            idx = self.membership.drop(idx, count=False)[0]
        if routed:
            plan = wire_rows(x, max_tokens, use_fp8)
        else:
            plan = dispatch_plan(x, idx, s.placement, max_tokens, use_fp8, compiled)
        empty = None if self.recycler is None else self.recycler.empty
        return plan, dispatch_outputs(plan, s.hidden, self.num_ranks, idx, self.num_experts, seq, empty)

    def ll_combine(
        self, x, topk_idx, topk_weights, handle, out: torch.Tensor | None, routed: bool
    ) -> LLCombineInputs:
        """A low-latency combine's inputs, checked; `routed` (the send half checks them and routes) no
        value of the handle or topk_idx is read on the host and no plan is built."""
        values = not routed
        compiled = None if routed or self.membership.masked else self.ll_engine
        if not isinstance(handle, LowLatencyHandle):
            raise TypeError(f"handle must come from Buffer.low_latency_dispatch, got {type(handle).__name__}")
        R, L, H = self.num_ranks, self.num_local_experts, self.sizing.hidden
        if handle.layout_range_LR2.shape[1] != R or handle.num_experts != self.num_experts:
            raise ValueError("handle comes from a Buffer with another group size or expert count")
        if values and (handle.recv_count_L < 0).any():  # handle.received, without a call
            raise ValueError("handle: its dispatch was not received yet; call its hook or event.wait() first")
        if handle.seq <= self.membership.stale_after:
            self.membership.check_handle(handle.seq)
        x = validate.expert_output(x, (L, R * handle.num_max_dispatch_tokens_per_rank, H), self.device)
        if self.slots.placement is not None:
            topk_idx = self.slots.physical_at(topk_idx, handle.seq)  # the map its dispatch used
        N, K = handle.num_tokens, self.sizing.max_topk
        idx = validate.topk_idx(topk_idx, N, self.num_experts, K, values and compiled is None, self.device)
        if self.membership.masked:
            idx = self.membership.drop(idx, count=False)[0]
        if handle.seq <= self.membership.after:  # masked inside a call since its dispatch: drop there too
            handle = replace(handle, topk_idx_NK=self.membership.drop(handle.topk_idx_NK, count=False)[0])
        if idx.shape != handle.topk_idx_NK.shape or (values and not torch.equal(idx, handle.topk_idx_NK)):
            raise ValueError("topk_idx must be the one passed to the low_latency_dispatch that made handle")
        w = validate.topk_weights(topk_weights, tuple(idx.shape), device=self.device)
        if out is None:
            out = torch.empty(N, H, dtype=x.dtype, device=x.device)
        else:
            out = validate.tensor("out", out, x.dtype, 2, self.device)
            if tuple(out.shape) != (N, H) or not out.is_contiguous():
                raise ValueError(f"out must be a contiguous [{N}, {H}] tensor")
        plan = None if routed else combine_plan(x, w, handle, self.sizing.placement, compiled)
        return LLCombineInputs(x=x, topk_idx_NK=idx, topk_weights_NK=w, out_NH=out, plan=plan)

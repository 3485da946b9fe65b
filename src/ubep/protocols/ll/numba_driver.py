"""Low-latency mode on compiled call halves: each send and receive half one entry (plus re-entries
while it waits), its status turned into the exceptions and words of `ubep.protocols.ll`.

    dispatch_rows: own topk_idx checked -> reuse wait (peers consumed call e - 2) -> puts + stamps
                   -> receive half (the hook): per source, wait, check, place
    combine_rows:  own handle and topk_idx checked -> reuse wait -> puts + stamps
                   -> receive half: wait, check, weighted sum

As the Triton halves (`ubep.protocols.ll.triton_driver`), the halves find every row's place from
topk_idx and the handle themselves, so a call has no host-built plan: the Buffer checks shapes,
allocates the outputs and enters each half once.

The halves are `ubep.protocols.ll.numba_halves`; `LLExchange` keeps the torch statement,
the reuse words' Python side (`abort`, `resume`) and delegates here where the
engine and the memory allow.

Legend: see `ubep.protocols.ll.plans`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ubep.calls import CallId
from ubep.faults import NO_FAULTS, FaultPoints
from ubep.protocols import halves
from ubep.protocols.base import CODE_DTYPES, CODE_RANGE, DTYPE_CODES, Sizing
from ubep.protocols.ll import numba_halves as k
from ubep.protocols.ll import status as ll_status
from ubep.protocols.ll.blocks import COMBINE, DISPATCH
from ubep.protocols.ll.plans import LLCombinePlan, LLDispatchOut, LLDispatchPlan, per_writer
from ubep.results import LowLatencyHandle
from ubep.transport.heap import Heap
from ubep.validate import repeated_expert

_NO_PLANE = np.empty((0, 0, 0), dtype=np.uint8)


class LLNumba(halves.HeapHalves):
    """Low-latency halves on a heap, each one compiled function; `release(call, kind)` is the
    exchange's Python release of a half (on every failure after the send).

    Like the Triton halves, the send halves route from the handle and topk_idx themselves and check
    this rank's inputs before any put (`dispatch_rows`, `combine_rows`): the Buffer reads none of
    their values on the host. A plan (`dispatch_send`, `combine_send`: with stats recorded) is
    taken for its rows only."""

    def __init__(
        self,
        heap: Heap,
        blocks,
        sizing: Sizing,
        release: Callable[[CallId, int], None],
        faults: FaultPoints = NO_FAULTS,
    ):
        super().__init__(heap, blocks)
        self.sizing, self.release, self.faults = sizing, release, faults
        self.row_bytes = sizing.row_bytes  # a slot's row stride in bytes
        self.per_writer = per_writer(sizing)  # rows in each expert rank's run of a home's back slots
        placement = sizing.placement
        self.rank_of_expert_E = placement.rank_of_expert_E.numpy()
        self.local_of_expert_E = placement.local_index_E.numpy()

    # -- dispatch ---------------------------------------------------------------------------------

    def dispatch_send(self, call: CallId, plan: LLDispatchPlan, out: LLDispatchOut) -> Callable[[], None]:
        return self.dispatch_rows(call, plan.rows_NB, plan.code, plan.max_tokens, out)

    def dispatch_rows(
        self, call: CallId, rows_NB: torch.Tensor, code: int, T: int, out: LLDispatchOut
    ) -> Callable[[], None]:
        """Send half: rows_NB uint8 [N, b] (the tokens in wire form) to every expert their topk_idx
        (out.handle's) selects; returns the receive half."""
        s, t = self.sizing, self.t
        topk_NK = out.handle.topk_idx_NK.numpy()
        status = np.zeros(6, dtype=np.int64)
        phase = "low-latency dispatch (buffer reuse)"  # the one wait in this half
        code_now = halves.run(
            t, call, phase, k.ll_dispatch_send, *self._memory(call), rows_NB.numpy(), topk_NK,
            self.rank_of_expert_E, self.local_of_expert_E, code, T, s.max_topk, s.capacity, self.row_bytes,
            self.wake, self.members, t.generation, np.empty(self.R, dtype=np.int64), *self.budget, status,
            block="send",
        )  # fmt: skip
        self._sent(call, phase, code_now, status, T, topk_NK)
        return lambda: self._receive_tokens(call, out)

    def _receive_tokens(self, call: CallId, out: LLDispatchOut) -> None:
        s, t, h = self.sizing, self.t, out.handle
        planes = [plane.numpy() for plane, _, _ in out.planes]
        live_R = np.zeros(self.R, dtype=np.uint8)
        live_R[t.live_R] = 1
        pending, status = np.empty(self.R, dtype=np.int64), np.zeros(6, dtype=np.int64)
        T = h.num_max_dispatch_tokens_per_rank
        try:
            code = halves.run(
                t,
                call,
                "low-latency dispatch (tokens)",
                k.ll_dispatch_recv,
                self.table,
                self.asleep,
                self.me,
                call.epoch,
                call.epoch & 1,
                live_R,
                out.code,
                T,
                s.max_topk,
                s.capacity,
                self.row_bytes,
                *CODE_RANGE,
                planes[0],
                planes[1] if len(planes) > 1 else _NO_PLANE,
                h.recv_src_token_LM.numpy(),
                h.recv_src_rank_LM.numpy(),
                h.recv_src_k_LM.numpy(),
                h.layout_range_LR2.numpy(),
                h.recv_count_L.numpy(),
                np.zeros(1 + h.recv_count_L.numel(), np.int64),
                self.wake,
                self.members,
                t.generation,
                pending,
                *self.budget,
                status,
            )
            if code == k.MASKED:  # what was read may not be whole
                t.check_member("low-latency dispatch")
                raise RuntimeError("low-latency dispatch: the peers masked this rank")  # raised already
            if code != k.DONE:
                raise self._error(call, "low-latency dispatch (tokens)", code, status, T)
            if status[5]:
                self.t.ring_marked(self.wake, call.timers)
        except BaseException:
            h.recv_count_L.fill_(-1)  # not received
            self.release(call, DISPATCH)
            raise

    # -- combine ----------------------------------------------------------------------------------

    def combine_send(self, call: CallId, plan: LLCombinePlan, out_NH: torch.Tensor) -> Callable[[], None]:
        x_LMH = plan.x_LMB.view(CODE_DTYPES[plan.code])
        return self.combine_rows(call, x_LMH, plan.topk_weights_NK, plan.handle, out_NH)

    def combine_rows(
        self,
        call: CallId,
        x_LMH: torch.Tensor,
        weights_NK: torch.Tensor,
        handle: LowLatencyHandle,
        out_NH: torch.Tensor,
        topk_NK: torch.Tensor | None = None,
    ) -> Callable[[], None]:
        """Send half: every row the dispatch of `handle` delivered, x_LMH [L, M, H] (bf16 or fp32,
        contiguous), back to its home; returns the receive half, which sums them into out_NH with
        weights_NK.
        topk_NK (int64, the handle's shape): the combine's topk_idx, which the half checks is the
        dispatch's (None: it is)."""
        t, code = self.t, DTYPE_CODES[x_LMH.dtype]
        dispatched = handle.topk_idx_NK.numpy()
        phase = "low-latency combine (buffer reuse)"
        args = (
            *self._memory(call), x_LMH.view(torch.uint8).numpy(), handle.layout_range_LR2.numpy(),
            handle.recv_count_L.numpy(), dispatched, dispatched if topk_NK is None else topk_NK.numpy(),
            code, self.per_writer, self.row_bytes, self.wake, self.members, t.generation,
        )  # fmt: skip
        pending, status = np.empty(self.R, dtype=np.int64), np.zeros(6, dtype=np.int64)
        if self.faults.armed:  # the fault tests' stop after a block and its check: split the loop there
            code_now = halves.run(
                t, call, phase, k.ll_combine_send, *args, 0, 1, pending, *self.budget, status, block="send"
            )
            self._sent(call, phase, code_now, status, code, dispatched)
            self.faults.at("ll_combine.put", call)
            code_now = halves.run(
                t,
                call,
                phase,
                k.ll_combine_send,
                *args,
                1,
                self.R,
                pending,
                *self.budget,
                status,
                block="send",
            )
        else:
            code_now = halves.run(
                t,
                call,
                phase,
                k.ll_combine_send,
                *args,
                0,
                self.R,
                pending,
                *self.budget,
                status,
                block="send",
            )
        self._sent(call, phase, code_now, status, code, dispatched)
        return lambda: self._reduce(call, dispatched, weights_NK, out_NH, code)

    def finish_combine(
        self, call: CallId, x_LMH: torch.Tensor, handle: LowLatencyHandle, weights_NK: torch.Tensor, out_NH
    ) -> None:
        """The receive half of combine `call` again, from `handle` as it is after a mask (its masked
        ranks' entries dropped), over the rows the staying ranks put (`LowLatencyExchange.finish_combine`)."""
        self._reduce(call, handle.topk_idx_NK.numpy(), weights_NK, out_NH, DTYPE_CODES[x_LMH.dtype])

    def _sent(self, call: CallId, phase: str, code: int, status: np.ndarray, mine: int, topk_NK) -> None:
        """After a send half: ring the peers it marked; raise its error, or MaskedOutError if the
        peers masked this rank."""
        if code == k.MASKED:
            self.sent(k.MASKED, phase)
        if code != k.DONE:
            raise self._error(call, phase, code, status, mine, topk_NK)
        if status[5]:
            self.t.ring_marked(self.wake, call.timers)

    def _reduce(
        self, call: CallId, topk_NK: np.ndarray, weights_NK: torch.Tensor, out_NH: torch.Tensor, code: int
    ) -> None:
        s, t = self.sizing, self.t
        out = out_NH.view(torch.uint16).numpy() if out_NH.dtype == torch.bfloat16 else out_NH.numpy()
        pending, status = np.empty(self.R, dtype=np.int64), np.zeros(6, dtype=np.int64)
        try:
            code_now = halves.run(
                t, call, "low-latency combine", k.ll_combine_recv, *self._memory(call), topk_NK,
                self.rank_of_expert_E, self.local_of_expert_E, code, *CODE_RANGE, s.capacity * s.max_topk,
                self.per_writer, self.row_bytes, weights_NK.numpy(), out, np.zeros(1, np.int64), self.wake,
                self.members, t.generation, pending, *self.budget, status,
            )  # fmt: skip
            if code_now == k.MASKED:  # the rows may not be whole
                t.check_member("low-latency combine")
                raise RuntimeError("low-latency combine: the peers masked this rank")  # raised already
            if code_now != k.DONE:
                raise self._error(call, "low-latency combine", code_now, status, code, topk_NK)
            if status[5]:
                self.t.ring_marked(self.wake, call.timers)
        except BaseException:
            self.release(call, COMBINE)
            raise

    def _error(
        self, call: CallId, phase: str, code: int, status: np.ndarray, mine: int, topk_NK=None
    ) -> Exception:
        """The exception for a half's error status (`ubep.protocols.ll.status`); a repeated expert in
        this rank's topk_idx in the host's words (`ubep.validate`), which name the row's values."""
        if code == k.E_REPEATED and topk_NK is not None:
            return repeated_expert(torch.from_numpy(topk_NK), int(status[4]))
        return ll_status.error(self.t, self.blocks, call, phase, code, status, mine)

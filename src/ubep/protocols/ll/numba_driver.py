"""Low-latency mode on compiled call halves: each send and receive half one entry (plus re-entries
while it waits), its status turned into the exceptions and words of `ubep.protocols.ll`.

    dispatch_send: reserve (peers consumed call e - 2) -> puts + stamps -> receive half (the hook)
    combine_send:  reserve -> puts + stamps -> receive half (wait, check, weighted sum)

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
from ubep.protocols.base import CODE_RANGE, Sizing
from ubep.protocols.ll import numba_halves as k
from ubep.protocols.ll import status as ll_status
from ubep.protocols.ll.blocks import COMBINE, DISPATCH
from ubep.protocols.ll.plans import LLCombinePlan, LLDispatchOut, LLDispatchPlan, per_writer
from ubep.transport.heap import Heap

_NO_PLANE = np.empty((0, 0, 0), dtype=np.uint8)


class LLNumba(halves.HeapHalves):
    """Low-latency halves on a heap, each one compiled function; `release(call, kind)` is the
    exchange's Python release of a half (on every failure after the send)."""

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

    def _reserve(self, call: CallId, kind: int, what: str) -> None:
        """Wait until every live peer consumed call e - 2 of this kind (it used the same half)."""
        t = self.t
        t.check_member(f"low-latency {what} (buffer reuse)")  # before writing into peers' memory
        pending, status = np.empty(self.R, dtype=np.int64), np.zeros(6, dtype=np.int64)
        args = (self.table, self.asleep, self.me, t.live_R, kind, call.epoch & 1, call.epoch, pending)
        code = halves.run(
            t, call, f"low-latency {what} (buffer reuse)", k.ll_reserve, *args, *self.budget, status
        )
        if code == k.E_MINE:
            raise RuntimeError(
                f"low-latency {what} #{call.epoch}: call #{call.epoch - 2} still awaits its receive half "
                "(hook or event.wait()); at most two low-latency calls of a kind may be in flight"
            )

    # -- dispatch ---------------------------------------------------------------------------------

    def dispatch_send(self, call: CallId, plan: LLDispatchPlan, out: LLDispatchOut) -> Callable[[], None]:
        s = self.sizing
        self._reserve(call, DISPATCH, "dispatch")
        woken = k.ll_dispatch_send(
            *self._memory(call),
            plan.rows_NB.numpy(),
            plan.pair_token_P.numpy(),
            plan.pair_k_P.numpy(),
            plan.pair_local_P.numpy(),
            plan.counts_RL.numpy(),
            plan.code,
            plan.max_tokens,
            s.max_topk,
            s.capacity,
            self.row_bytes,
            self.wake,
            self.members,
            self.t.generation,
        )
        if woken:
            self.sent(woken, "low-latency dispatch (send)")
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
                pending,
                *self.budget,
                status,
            )
            if code != k.DONE:
                raise self._error(call, "low-latency dispatch (tokens)", code, status, T)
            if status[5]:
                self.t.ring_marked(self.wake)
            t.check_member("low-latency dispatch")  # what was read above was whole
        except BaseException:
            h.recv_count_L.fill_(-1)  # not received
            self.release(call, DISPATCH)
            raise

    # -- combine ----------------------------------------------------------------------------------

    def combine_send(self, call: CallId, plan: LLCombinePlan, out_NH: torch.Tensor) -> Callable[[], None]:
        self._reserve(call, COMBINE, "combine")
        args = (
            *self._memory(call),
            plan.x_LMB.numpy(),
            plan.local_Q.numpy(),
            plan.row_Q.numpy(),
            plan.send_counts_R.numpy(),
            plan.code,
            self.per_writer,
            self.row_bytes,
            self.wake,
            self.members,
            self.t.generation,
        )
        if self.faults.armed:  # the fault tests' stop after a block and its check: split the loop there
            if woken := k.ll_combine_send(*args, 0, 1):
                self.sent(woken, "low-latency combine (send)")
            self.faults.at("ll_combine.put", call)
            args = (*args, 1, self.R)
        else:
            args = (*args, 0, self.R)
        if woken := k.ll_combine_send(*args):
            self.sent(woken, "low-latency combine (send)")
        return lambda: self._reduce(call, plan, out_NH)

    def _reduce(self, call: CallId, plan: LLCombinePlan, out_NH: torch.Tensor) -> None:
        s, t = self.sizing, self.t
        expected_R = torch.bincount(plan.owner_NK[plan.valid_NK], minlength=self.R)
        out = out_NH.view(torch.uint16).numpy() if out_NH.dtype == torch.bfloat16 else out_NH.numpy()
        pending, status = np.empty(self.R, dtype=np.int64), np.zeros(6, dtype=np.int64)
        try:
            code = halves.run(
                t,
                call,
                "low-latency combine",
                k.ll_combine_recv,
                self.table,
                self.asleep,
                self.me,
                call.epoch,
                call.epoch & 1,
                t.live_R,
                expected_R.numpy(),
                plan.code,
                *CODE_RANGE,
                s.capacity * s.max_topk,
                self.per_writer,
                self.row_bytes,
                plan.topk_weights_NK.numpy(),
                plan.valid_NK.view(torch.uint8).numpy(),
                plan.owner_NK.numpy(),
                plan.local_NK.numpy(),
                plan.num_local_experts,
                out,
                np.zeros(1, np.int64),
                self.wake,
                pending,
                *self.budget,
                status,
            )
            if code != k.DONE:
                raise self._error(call, "low-latency combine", code, status, plan.code)
            if status[5]:
                self.t.ring_marked(self.wake)
            t.check_member("low-latency combine")  # the rows were whole
        except BaseException:
            self.release(call, COMBINE)
            raise

    def _error(self, call: CallId, phase: str, code: int, status: np.ndarray, mine: int) -> Exception:
        """The exception for a half's error status (`ubep.protocols.ll.status`)."""
        return ll_status.error(self.t, self.blocks, call, phase, code, status, mine)

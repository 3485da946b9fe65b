"""The UBEP protocol on compiled call halves: Python enters each half once, and turns its status
into results or the exceptions of docs/reliability.md.

    dispatch: send half (routing, lists, rows, stamps) -> routes (wait, check, counts)
              -> allocate recv_x -> gather (local top-k, rows as each source lands)
    combine:  send half (rows, weights, header) -> reduce (wait, check, sum in rank order)

The halves themselves are `ubep.engine.ubep_halves` (numba, GIL released), over the
address table the heap built once; they keep `ubep.protocols.ubep`'s memory layout
word for word, which stays the readable statement and the test oracle. A half that
returns WAITING has already spun and yielded; Python then sleeps on the doorbell
under the deadline, with the dead-peer and abort checks (`Heap.sleeper`), and
enters it again. Fault points stay where the torch statement has them.

Legend: see `ubep.layout`.
"""

from __future__ import annotations

import numpy as np
import torch

from ubep.calls import CallId
from ubep.engine import ubep_halves as k
from ubep.faults import FaultPoints
from ubep.protocols import halves, ubep_status
from ubep.protocols.base import CODE_RANGE, DTYPE_CODES, Received, SendPlan, Sizing
from ubep.results import DispatchHandle, RecvRoute
from ubep.transport.heap import Heap

_NO_I64 = np.empty((0, 0), dtype=np.int64)
_NO_F32 = np.empty((0, 0), dtype=np.float32)


def bits_of(t: torch.Tensor) -> np.ndarray:
    """A float tensor as numpy elements numba reduces: float32 itself, bf16 as uint16 bits."""
    return t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


class UbepCompiled(halves.HeapHalves):
    """UBEP dispatch/combine on a heap, each call half one compiled function."""

    def __init__(self, heap: Heap, blocks, sizing: Sizing, faults: FaultPoints, local_of_E: torch.Tensor):
        super().__init__(heap, blocks)
        self.sizing, self.faults = sizing, faults
        self.L = sizing.placement.num_local_experts
        self.local_of_expert = local_of_E.numpy()  # int64 [E]: local id here, -1 elsewhere

    def _enter(self, call: CallId, phase: str, mine: tuple, half, *args) -> None:
        """Run a resumable half to DONE, or raise its error; `mine` is (dtype, top-k, dispatch seq)
        of this rank's call, for the error's words."""
        code = halves.run(self.t, call, phase, half, *args)
        if code != k.DONE:
            raise ubep_status.error(self.t, self.blocks, call, code, args[-1], *mine)

    # -- dispatch ---------------------------------------------------------------------------------

    def dispatch(self, call: CallId, plan: SendPlan, handle: DispatchHandle | None) -> Received:
        s, t, R, mem = self.sizing, self.t, self.R, self._memory(call)
        x_NH, cached = plan.x_NH, handle is not None
        (N, H), code = x_NH.shape, DTYPE_CODES[x_NH.dtype]
        K = 0 if cached else plan.topk_idx_NK.shape[1]
        routing = None if cached else (plan.topk_idx_NK.numpy(), plan.topk_weights_NK.numpy())
        topk, weights = routing or (_NO_I64, _NO_F32)
        announced = self.faults.count("dispatch.count", call, N) if self.faults.armed else N
        scales = _NO_F32 if plan.scales_NS is None else plan.scales_NS.numpy()
        woken = k.dispatch_send(
            *mem, x_NH.view(torch.uint8).numpy(), scales, topk, weights,
            plan.is_token_in_rank_NR.view(torch.uint8).numpy(), plan.send_counts_R.numpy(),
            announced, code, s.max_topk, s.capacity, self.wake,
        )  # fmt: skip
        if woken:
            t.ring_marked(self.wake)
        if self.faults.armed:
            self.faults.at("dispatch.sent", call)
        counts_R, sent_R = np.empty(R, dtype=np.int64), np.empty(R, dtype=np.int64)
        pending, status = np.empty(R, dtype=np.int64), np.zeros(6, dtype=np.int64)
        mine = (x_NH.dtype, K, 0)
        self._enter(
            call, "dispatch (routing)", mine, k.dispatch_routes, *mem, code, K, s.max_topk, s.capacity,
            *CODE_RANGE, np.zeros(R, dtype=np.int64), counts_R, sent_R, pending, *self.budget, status,
        )  # fmt: skip
        if cached:
            prefix_R1, src_token_M = handle.recv.prefix_R1, handle.recv.src_token_M
        else:
            prefix_R1 = torch.zeros(R + 1, dtype=torch.int64)
            counts_R.cumsum(out=prefix_R1.numpy()[1:])
            src_token_M = torch.empty(int(prefix_R1[-1]), dtype=torch.int64)
        M = src_token_M.shape[0]
        src_rank_M = handle.recv.src_rank_M if cached else torch.empty(M, dtype=torch.int64)
        per_expert_L = np.empty(0 if cached else self.L, dtype=np.int64)
        recv_x_MH = torch.empty(M, H, dtype=x_NH.dtype)
        recv_scales_MS = None if plan.scales_NS is None else torch.empty(M, plan.scales_NS.shape[1])
        recv_idx_MK = None if cached else torch.empty(M, K, dtype=torch.int64)
        recv_w_MK = None if cached else torch.empty(M, K, dtype=torch.float32)
        self._enter(
            call, "dispatch (tokens)", mine, k.dispatch_gather, *mem, prefix_R1.numpy(), counts_R, sent_R,
            s.capacity, s.max_topk, self.local_of_expert,
            _NO_I64 if cached else recv_idx_MK.numpy(), _NO_F32 if cached else recv_w_MK.numpy(),
            src_token_M.numpy(), src_rank_M.numpy(), per_expert_L, recv_x_MH.view(torch.uint8).numpy(),
            _NO_F32 if recv_scales_MS is None else recv_scales_MS.numpy(),
            np.zeros(R + 1, dtype=np.int64), pending, *self.budget, status,
        )  # fmt: skip
        t.check_member("dispatch")  # what was read above was whole
        route = handle.recv if cached else RecvRoute(src_token_M, prefix_R1, src_rank_M)
        return Received(recv_x_MH, recv_idx_MK, recv_w_MK, route, recv_scales_MS, per_expert_L)

    # -- combine ----------------------------------------------------------------------------------

    def combine(self, call: CallId, x_MH: torch.Tensor, handle: DispatchHandle, topk_weights_MK):
        self.send_back(call, x_MH, handle, topk_weights_MK)
        if self.faults.armed:
            self.faults.at("combine.mid", call)
        return self.reduce_home(call, "combine", x_MH, handle, topk_weights_MK)

    def send_back(self, call: CallId, x_MH: torch.Tensor, handle: DispatchHandle, topk_weights_MK) -> None:
        """An expert rank's half of combine: its output rows and weights out once, then the stamp."""
        weights = _NO_F32 if topk_weights_MK is None else topk_weights_MK.numpy()
        woken = k.combine_send(
            *self._memory(call), x_MH.view(torch.uint8).numpy(), weights, self.sizing.max_topk,
            handle.recv.prefix_R1.numpy(), handle.seq, DTYPE_CODES[x_MH.dtype], self.wake,
        )  # fmt: skip
        if woken:
            self.t.ring_marked(self.wake)

    def reduce_home(self, call: CallId, phase: str, x_MH: torch.Tensor, handle: DispatchHandle, weights_MK):
        """The home's half of combine: (combined [N, H] in x's dtype, summed weights [N, K] or None)."""
        s, R = self.sizing, self.R
        K = 0 if weights_MK is None else weights_MK.shape[1]
        out_NH = torch.empty(handle.num_tokens, x_MH.shape[1], dtype=x_MH.dtype)
        out_NK = None if K == 0 else torch.empty(handle.num_tokens, K, dtype=torch.float32)
        pending, status = np.empty(R, dtype=np.int64), np.zeros(6, dtype=np.int64)
        self._enter(
            call, phase, (x_MH.dtype, K, handle.seq), k.combine_reduce, *self._memory(call),
            handle.is_token_in_rank_NR.view(torch.uint8).numpy(), handle.send_counts_R.numpy(), handle.seq,
            DTYPE_CODES[x_MH.dtype], *CODE_RANGE, s.max_topk, R * s.capacity, bits_of(out_NH),
            _NO_F32 if out_NK is None else out_NK.numpy(), np.zeros(R, dtype=np.int64), pending,
            *self.budget, status,
        )  # fmt: skip
        self.t.check_member("combine")  # what was read above was whole
        return out_NH, out_NK

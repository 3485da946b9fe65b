"""The BSP baseline on compiled phases: the same barriers, count round and staging copy as
`ubep.protocols.bsp.exchange` (the statement in torch), each phase one compiled function.

    dispatch: counts -> barrier -> send (push into staging slots) -> barrier
              -> verify (flags, formats, counts) -> barrier -> reorder (staging -> recv_x)
    combine:  barrier -> send back -> barrier -> reduce   (normal mode's: `ubep.protocols.combine`)

Legend: see `ubep.layout`.
"""

from __future__ import annotations

import numpy as np
import torch

from ubep.calls import CallId
from ubep.faults import FaultPoints
from ubep.layout import prefix_offsets
from ubep.protocols import halves
from ubep.protocols.base import CODE_RANGE, DTYPE_CODES, Received, SendPlan, Sizing
from ubep.protocols.bsp import numba_halves as k
from ubep.protocols.bsp import status as bsp_status
from ubep.protocols.combine.numba_driver import NO_F32, NO_I64, NormalNumba
from ubep.results import DispatchHandle, RecvRoute
from ubep.transport.heap import Heap


class BspNumba(NormalNumba):
    """Barrier-separated dispatch/combine on a heap, each phase one compiled function."""

    def __init__(self, heap: Heap, blocks, sizing: Sizing, faults: FaultPoints, local_of_RE: torch.Tensor):
        super().__init__(heap, blocks, sizing, faults)
        self.local_of_RE = local_of_RE.numpy()  # int64 [R, E]: each rank's local id of each expert

    def _barrier(self, call: CallId, phase: str) -> None:
        t = self.t
        t.check_member(phase)  # before a barrier or a put into peers' memory
        barrier, notice = t.control_words(call)
        pending, status = np.empty(self.R, dtype=np.int64), np.zeros(6, dtype=np.int64)
        target = t.barrier_target(phase, call)
        args = (barrier, notice, self.asleep, self.me, t.live_R, target, call.seq, self.wake, pending)
        halves.run(t, call, phase, k.bsp_barrier, *args, *self.budget, status)  # a peer's abort raises
        if status[5]:
            t.ring_marked(self.wake)

    # -- dispatch ---------------------------------------------------------------------------------

    def dispatch(self, call: CallId, plan: SendPlan, handle: DispatchHandle | None) -> Received:
        s, t, R, me, epoch = self.sizing, self.t, self.R, self.me, call.epoch
        x_NH, cached = plan.x_NH, handle is not None
        K = 0 if cached else plan.topk_idx_NK.shape[1]
        counts = plan.send_counts_R
        if self.faults.armed:  # maybe a corrupt count, the same to every destination
            counts = torch.as_tensor(
                self.faults.count("dispatch.count", call, counts), dtype=torch.int64, device="cpu"
            )
        k.bsp_counts(self.table, me, epoch, np.ascontiguousarray(counts.expand(R).numpy()))
        self._barrier(call, "dispatch (count exchange)")
        routing = None if cached else (plan.topk_idx_NK.numpy(), plan.topk_weights_NK.numpy())
        woken = k.bsp_send(
            self.table, self.asleep, me, epoch, t.live_R, x_NH.view(torch.uint8).numpy(),
            NO_F32 if plan.scales_NS is None else plan.scales_NS.numpy(), *(routing or (NO_I64, NO_F32)),
            plan.is_token_in_rank_NR.view(torch.uint8).numpy(), self.local_of_RE, DTYPE_CODES[x_NH.dtype],
            s.max_topk, s.capacity, s.row_bytes, self.wake, self.members, t.generation,
        )  # fmt: skip
        if woken:
            self.sent(woken, "dispatch (token send)")
        if self.faults.armed:
            self.faults.at("dispatch.sent", call)
        self._barrier(call, "dispatch (token send)")
        counts_R = torch.empty(R, dtype=torch.int64, device="cpu")
        pending, status = np.empty(R, dtype=np.int64), np.zeros(6, dtype=np.int64)
        code = k.bsp_verify(
            self.table, me, epoch, t.live_R, DTYPE_CODES[x_NH.dtype], K, s.max_topk, s.capacity, *CODE_RANGE,
            counts_R.numpy(), pending, status,
        )  # fmt: skip
        if code != k.DONE:
            raise bsp_status.error(t, self.blocks, call, code, status, pending, x_NH.dtype, K)
        self._barrier(call, "dispatch (prefix sums)")
        prefix_R1 = prefix_offsets(counts_R)
        M, H = int(prefix_R1[-1]), x_NH.shape[1]
        recv_x_MH = torch.empty(M, H, dtype=x_NH.dtype, device="cpu")
        scales_NS = plan.scales_NS
        scales = (
            None
            if scales_NS is None
            else torch.empty(M, scales_NS.shape[1], dtype=scales_NS.dtype, device="cpu")
        )
        recv_idx = torch.empty(M, K, dtype=torch.int64, device="cpu")
        recv_w = torch.empty(M, K, dtype=torch.float32, device="cpu")
        src_token = torch.empty(M, dtype=torch.int64, device="cpu")
        code = k.bsp_reorder(
            self.table, me, prefix_R1.numpy(), s.capacity, s.max_topk, s.placement.num_local_experts,
            s.row_bytes, recv_x_MH.view(torch.uint8).numpy(), NO_F32 if scales is None else scales.numpy(),
            recv_idx.numpy(), recv_w.numpy(), src_token.numpy(), status,
        )  # fmt: skip
        if code != k.DONE:
            raise bsp_status.error(t, self.blocks, call, code, status, pending, x_NH.dtype, K)
        route = RecvRoute.of(src_token, prefix_R1)
        return Received(recv_x_MH, None if cached else recv_idx, None if cached else recv_w, route, scales)

    # -- combine ----------------------------------------------------------------------------------

    def combine(self, call: CallId, x_MH: torch.Tensor, handle: DispatchHandle, topk_weights_MK):
        self._barrier(call, "combine (start)")
        self.send_back(call, x_MH, handle, topk_weights_MK)
        if self.faults.armed:
            self.faults.at("combine.mid", call)
        self._barrier(call, "combine (token send)")
        return self.reduce_home(call, "combine (reduce)", x_MH, handle, topk_weights_MK)

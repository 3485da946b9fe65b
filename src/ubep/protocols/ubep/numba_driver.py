"""The UBEP protocol on compiled call halves: Python enters each half once, and turns its status
into results or the exceptions of docs/reliability.md.

    dispatch: send half (routing, lists, rows, stamps) -> routes (wait, check, counts)
              -> allocate recv_x -> gather (local top-k, rows as each source lands)
    combine:  send half (rows, weights, header) -> reduce (wait, check, sum in rank order)
              (normal mode's: `ubep.protocols.combine.numba_driver`)

The halves themselves are `ubep.protocols.ubep.numba_halves` (numba, GIL released), over the
address table the heap built once; they keep `ubep.protocols.ubep.blocks`' memory layout
word for word, and the torch statement stays the readable form and the test oracle. A half that
returns WAITING has already spun and yielded; Python then sleeps on the doorbell
under the deadline, with the dead-peer and abort checks (`Heap.sleeper`), and
enters it again. Fault points stay where the torch statement has them.

Legend: see `ubep.layout`.
"""

from __future__ import annotations

import numpy as np
import torch

from ubep.calls import CallId
from ubep.engine.numba_engine import tensors
from ubep.faults import FaultPoints
from ubep.protocols.base import CODE_RANGE, DTYPE_CODES, Received, SendPlan, Sizing
from ubep.protocols.combine.numba_driver import NO_F32, NO_I64, NormalNumba
from ubep.protocols.ubep import numba_halves as k
from ubep.protocols.ubep import status as ubep_status
from ubep.results import DispatchHandle, RecvRoute
from ubep.transport.heap import Heap


class UbepNumba(NormalNumba):
    """UBEP dispatch/combine on a heap, each call half one compiled function."""

    def __init__(self, heap: Heap, blocks, sizing: Sizing, faults: FaultPoints, local_of_E: torch.Tensor):
        super().__init__(heap, blocks, sizing, faults)
        self.L = sizing.placement.num_local_experts
        self.local_of_expert = local_of_E.numpy()  # int64 [E]: local id here, -1 elsewhere

    def dispatch_error(self, call: CallId, code: int, status: np.ndarray, mine: tuple) -> Exception:
        return ubep_status.error(self.t, self.blocks, call, code, status, *mine)

    # -- dispatch ---------------------------------------------------------------------------------

    def dispatch(self, call: CallId, plan: SendPlan, handle: DispatchHandle | None) -> Received:
        s, t, R, mem = self.sizing, self.t, self.R, self._memory(call)
        x_NH, cached = plan.x_NH, handle is not None
        (N, H), code = x_NH.shape, DTYPE_CODES[x_NH.dtype]
        K = 0 if cached else plan.topk_idx_NK.shape[1]
        routing = None if cached else (plan.topk_idx_NK.numpy(), plan.topk_weights_NK.numpy())
        topk, weights = routing or (NO_I64, NO_F32)
        announced = self.faults.count("dispatch.count", call, N) if self.faults.armed else N
        scales = NO_F32 if plan.scales_NS is None else plan.scales_NS.numpy()
        times = call.timers
        if times is not None:
            times.lap("between")
        woken = k.dispatch_send(
            *mem, x_NH.view(torch.uint8).numpy(), scales, topk, weights,
            plan.is_token_in_rank_NR.view(torch.uint8).numpy(), plan.send_counts_R.numpy(),
            announced, code, s.max_topk, s.capacity, self.wake,
        )  # fmt: skip
        if woken:
            t.ring_marked(self.wake, times)
        if times is not None:
            times.lap("send")
        if self.faults.armed:
            self.faults.at("dispatch.sent", call)
        counts_R, sent_R = np.empty(R, dtype=np.int64), np.empty(R, dtype=np.int64)
        pending, status = np.empty(R, dtype=np.int64), np.zeros(6, dtype=np.int64)
        mine = (x_NH.dtype, K, 0)
        self._enter(
            call, "dispatch (routing)", mine, k.dispatch_routes, *mem, code, K, s.max_topk, s.capacity,
            *CODE_RANGE, np.zeros(R, dtype=np.int64), counts_R, sent_R, pending, *self.budget, status,
        )  # fmt: skip
        # outputs the halves fill: numpy arrays, wrapped for the results (`tensors`: no copy)
        if cached:
            prefix, src_token = handle.recv.prefix_R1.numpy(), handle.recv.src_token_M.numpy()
        else:
            prefix = np.zeros(R + 1, dtype=np.int64)
            counts_R.cumsum(out=prefix[1:])
            src_token = np.empty(prefix[-1], dtype=np.int64)
        M = src_token.shape[0]
        src_rank = handle.recv.src_rank_M.numpy() if cached else np.empty(M, dtype=np.int64)
        per_expert_L = np.empty(0 if cached else self.L, dtype=np.int64)
        recv_x_MH = torch.empty(M, H, dtype=x_NH.dtype, device="cpu")
        scales_NS = plan.scales_NS
        recv_scales_MS = (
            None
            if scales_NS is None
            else torch.empty(M, scales_NS.shape[1], dtype=scales_NS.dtype, device="cpu")
        )
        recv_idx = NO_I64 if cached else np.empty((M, K), dtype=np.int64)
        recv_w = NO_F32 if cached else np.empty((M, K), dtype=np.float32)
        self._enter(
            call, "dispatch (tokens)", mine, k.dispatch_gather, *mem, prefix, counts_R, sent_R,
            s.capacity, s.max_topk, self.local_of_expert, recv_idx, recv_w, src_token, src_rank, per_expert_L,
            recv_x_MH.view(torch.uint8).numpy(), NO_F32 if recv_scales_MS is None else recv_scales_MS.numpy(),
            np.zeros(R + 1, dtype=np.int64), pending, *self.budget, status,
        )  # fmt: skip
        t.check_member("dispatch")  # what was read above was whole
        if cached:
            return Received(recv_x_MH, None, None, handle.recv, recv_scales_MS, per_expert_L)
        token_M, prefix_R1, rank_M, idx_MK, w_MK = tensors(src_token, prefix, src_rank, recv_idx, recv_w)
        return Received(
            recv_x_MH, idx_MK, w_MK, RecvRoute(token_M, prefix_R1, rank_M), recv_scales_MS, per_expert_L
        )

    # -- combine ----------------------------------------------------------------------------------

    def combine(self, call: CallId, x_MH: torch.Tensor, handle: DispatchHandle, topk_weights_MK):
        self.send_back(call, x_MH, handle, topk_weights_MK)
        if self.faults.armed:
            self.faults.at("combine.mid", call)
        return self.reduce_home(call, "combine", x_MH, handle, topk_weights_MK)

"""The BSP baseline on Triton kernels: the same barriers, count round and staging copy as the
statement in torch (`ubep.protocols.bsp.exchange`), each phase and each barrier one launch over the
heap's address table (`ubep.protocols.bsp.triton_halves`).

    dispatch: counts -> barrier -> send (push into staging slots) -> barrier
              -> verify (flags, formats, counts, prefix) -> barrier
              -> [recv size: num_worst_tokens, the handle's, or ONE count read on the host] -> reorder
    combine:  barrier -> send back -> barrier -> reduce   (normal mode's: `ubep.protocols.combine`)

A barrier is a kernel: this rank raises its word (`BspBlocks.barrier`, in device
memory) to a target derived from the call (seq * BARRIERS_PER_CALL + step, as the
host's barriers), then waits, bounded, for every live peer's word. Every phase
of a call shares one status word, and a phase finds a failed or timed-out one
before it and does nothing. Waiting, relaunching, `capturable` and `check()` are
`NormalTriton`'s. Unlike the UBEP halves, a Triton rank and a numba rank cannot
share a BSP call: their barrier words differ (the numba phases use the host's).

Legend: see `ubep.layout`.
"""

from __future__ import annotations

import torch

from ubep.calls import CallId
from ubep.faults import FaultPoints
from ubep.protocols.base import CODE_RANGE, DTYPE_CODES, Received, SendPlan, Sizing
from ubep.protocols.bsp import status as bsp_status
from ubep.protocols.bsp import triton_halves as k
from ubep.protocols.combine.triton_driver import ROWS_PER_PROGRAM, TOKENS_PER_PROGRAM, NormalTriton
from ubep.protocols.device_halves import TL_WORDS, cdiv, pow2
from ubep.results import DispatchHandle, RecvRoute
from ubep.transport.heap import BARRIERS_PER_CALL


class BspTriton(NormalTriton):
    """Barrier-separated dispatch/combine on a heap with an address table, each phase one Triton kernel."""

    REDUCE_PHASE = "combine (reduce)"

    def __init__(
        self,
        heap,
        blocks,
        sizing: Sizing,
        faults: FaultPoints,
        local_of_RE: torch.Tensor,
        engine,
        capturable: bool = False,
        max_spins: int | None = None,
    ):
        super().__init__(heap, blocks, sizing, faults, local_of_RE[heap.rank], engine, capturable, max_spins)
        self.local_of_RE = local_of_RE.to(torch.int64).to(self.device)  # int64 [R, E]: each rank's local ids
        self._pending = self._zeros(self.R)  # sources whose staging flag is missing (E_MISSING)

    def dispatch_error(self, call: CallId, phase: str, code: int, words, mine: tuple) -> Exception:
        return bsp_status.error(self.t, self.blocks, call, code, words, self._pending.cpu().numpy(), *mine)

    def _barrier(self, call: CallId, phase: str, step: int, status: torch.Tensor, mine: tuple) -> None:
        """The step-th barrier of `call`: every live rank's word reaches the same target."""
        self.t.check_member(phase)  # before a barrier or a put into peers' memory
        if self.capturable:  # the device's own count of calls
            targets = self._calls[0:1] * BARRIERS_PER_CALL + step
        else:
            targets = torch.tensor([call.seq * BARRIERS_PER_CALL + step], dtype=torch.int64, device="cpu").to(
                self.device
            )
        args = (self.table, self._live(), self.me, targets, self.R, status, self.max_spins)
        self._half(call, phase, k.bsp_barrier_kernel, (1,), args, {}, mine, rings=True)

    # -- dispatch ---------------------------------------------------------------------------------

    def dispatch_send(self, call: CallId, plan: SendPlan, handle: DispatchHandle | None):
        """Counts, barrier, token send, barrier (every rank's part before any rank reads); returns the
        rest (verify, barrier, reorder). Its barriers need every rank's kernels running at once."""
        s, R, dev = self.sizing, self.R, self.device
        x_NH, cached = plan.x_NH, handle is not None
        N, code = x_NH.shape[0], DTYPE_CODES[x_NH.dtype]
        K = 0 if cached else plan.topk_idx_NK.shape[1]
        epochs, status, mine = self._epoch(call), self._zeros(8), (x_NH.dtype, K)
        routed = plan.layout_by_send and not cached
        counts = plan.send_counts_R if routed else plan.send_counts_R.to(dev)
        forced = self.faults.count("dispatch.count", call, -1) if self.faults.armed else -1  # a corrupt count
        topk, in_rank = self._zeros(N, 0) if cached else plan.topk_idx_NK, plan.is_token_in_rank_NR
        args = (
            self.table, self.me, epochs, counts, R, topk, N, K, in_rank.view(torch.uint8), self.owner_E,
            s.placement.num_experts, forced, status,
        )  # fmt: skip
        consts = dict(NB=TOKENS_PER_PROGRAM, KB=pow2(K, 2), RB=pow2(R, 2), ROUTED=routed)
        self._once(call, "dispatch (input)", k.bsp_counts_kernel, (1,), args, consts, mine)
        self._barrier(call, "dispatch (count exchange)", 1, status, mine)
        rows_NB = x_NH.contiguous().view(torch.uint8)  # [N, H * itemsize]
        dtype, size = self._word(rows_NB.shape[1], s.row_bytes)
        scales = (
            self._zeros(N, 0, dtype=torch.int32)
            if plan.scales_NS is None
            else plan.scales_NS.view(torch.int32)
        )
        weights = self._zeros(N, 0, dtype=torch.float32) if cached else plan.topk_weights_NK
        blocks = max(cdiv(N, TOKENS_PER_PROGRAM), 1)
        self.engine.launch(
            k.bsp_send_kernel, (R, blocks),
            self.table, self._live(), self.me, epochs, rows_NB.view(dtype), rows_NB.shape[1] // size,
            rows_NB.shape[1], scales, scales.shape[1], topk, weights, N, K,
            in_rank.view(torch.uint8), R, self.local_of_RE, s.placement.num_experts, code,
            s.max_topk, s.capacity, s.row_bytes, self._zeros(R), blocks, status,
            WORD=TL_WORDS[dtype], NB=TOKENS_PER_PROGRAM, KB=pow2(K, 2), WB=128,
        )  # fmt: skip
        self._wake()
        if self.faults.armed:
            self.faults.at("dispatch.sent", call)
        self._barrier(call, "dispatch (token send)", 2, status, mine)
        worst = handle.padded_to if cached else plan.num_worst_tokens  # a cached dispatch pads as its handle
        return lambda: self._verify_and_reorder(call, epochs, plan, handle, worst, dtype, status)

    def _verify_and_reorder(
        self, call: CallId, epochs: torch.Tensor, plan: SendPlan, handle, worst: int, dtype, status
    ) -> Received:
        """Verify, barrier, reorder: the rows staged here into their final place."""
        s, R, dev = self.sizing, self.R, self.device
        x_NH, cached = plan.x_NH, handle is not None
        H, code = x_NH.shape[1], DTYPE_CODES[x_NH.dtype]
        K = 0 if cached else plan.topk_idx_NK.shape[1]
        mine, counts_R, prefix_R1 = (x_NH.dtype, K), self._zeros(R), self._zeros(R + 1)
        args = (
            self.table, self._live(), self.me, epochs, R, code, K, s.max_topk, s.capacity, *CODE_RANGE,
            counts_R, prefix_R1, worst, self._pending, status,
        )  # fmt: skip
        self._once(
            call, "dispatch (flag verification)", k.bsp_verify_kernel, (1,), args, dict(RB=pow2(R, 2)), mine
        )
        self._barrier(call, "dispatch (prefix sums)", 3, status, mine)
        M = self._received_rows(handle, worst, prefix_R1)
        fill = torch.zeros if worst else torch.empty  # padding rows stay 0
        recv_x_MH = fill(M, H, dtype=x_NH.dtype, device=dev)
        recv_scales_MS = None if plan.scales_NS is None else fill(M, plan.scales_NS.shape[1], device=dev)
        recv_idx_MK = torch.full((M, K), -1, dtype=torch.int64, device=dev)
        recv_w_MK = torch.zeros(M, K, dtype=torch.float32, device=dev)
        src_token_M = torch.full((M,), -1, dtype=torch.int64, device=dev)
        src_rank_M = torch.full((M,), -1, dtype=torch.int64, device=dev)
        x_MB = recv_x_MH.view(torch.uint8).view(dtype)
        scales_MS = self._zeros(M, 0, dtype=torch.int32) if recv_scales_MS is None else recv_scales_MS
        blocks = cdiv(s.capacity, ROWS_PER_PROGRAM)
        args = (
            self.table, self.me, prefix_R1, R, s.capacity, s.max_topk, s.placement.num_local_experts,
            s.row_bytes, x_MB, x_MB.shape[1], scales_MS.view(torch.int32), scales_MS.shape[1], recv_idx_MK,
            recv_w_MK, K, src_token_M, src_rank_M, status,
        )  # fmt: skip
        consts = dict(WORD=TL_WORDS[dtype], IB=ROWS_PER_PROGRAM, KB=pow2(K, 2), WB=128)
        self._once(call, "dispatch (reorder)", k.bsp_reorder_kernel, (R, blocks), args, consts, mine)
        route = RecvRoute(src_token_M, prefix_R1, src_rank_M)
        return Received(recv_x_MH, None if cached else recv_idx_MK, None if cached else recv_w_MK, route,
                        recv_scales_MS)  # fmt: skip

    # -- combine ----------------------------------------------------------------------------------

    def combine_send(self, call: CallId, x_MH: torch.Tensor, handle: DispatchHandle, topk_weights_MK):
        """Barrier, send back, barrier; returns the reduce half (normal mode's)."""
        epochs, status = self._epoch(call), self._zeros(8)
        K = 0 if topk_weights_MK is None else topk_weights_MK.shape[1]
        mine = (x_MH.dtype, K, handle.seq)
        self._barrier(call, "combine (start)", 1, status, mine)
        self.send_back(call, epochs, x_MH, handle, topk_weights_MK)
        if self.faults.armed:
            self.faults.at("combine.mid", call)
        self._barrier(call, "combine (token send)", 2, status, mine)
        return lambda: self.reduce_home(call, epochs, x_MH, handle, topk_weights_MK)

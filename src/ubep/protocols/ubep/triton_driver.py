"""The UBEP protocol on Triton call halves: each half one kernel launch over the heap's address table
(`ubep.protocols.ubep.triton_halves`), its status turned into the exceptions of the torch statement.

    dispatch: send (lists, rows, stamps) -> routes (waits, checks, counts, prefix)
              -> [recv size: num_worst_tokens, the handle's, or ONE count read on the host]
              -> gather ((source, row block) programs: local top-k, rows as each source lands)
    combine:  send (rows, weights, header, stamp) -> reduce (token programs: waits, checks, sums)
              (normal mode's: `ubep.protocols.combine.triton_driver`)

The kernels keep `ubep.protocols.ubep.blocks`' memory layout word for word, so the
numba halves, these and the torch statement agree bit for bit. Every count,
position and check is computed on the device; nothing in a half reads device
memory on the host. The receive size is the one exception, and only without
`num_worst_tokens`: the rows a dispatch receives decide recv_x's shape, so the
host reads that one count (prefix[R]) between the routes and the gather. With
`num_worst_tokens` the outputs have that many rows (the padding: recv_x 0,
recv_topk_idx -1, recv_topk_weights 0, src_token and src_rank -1), and a
dispatch + combine reads nothing on the host. A cached dispatch takes its size
from the handle.

Two ways to run, as `ubep.protocols.ll.triton_driver`:
- `capturable=False` (the Buffer, tests): after each launch the host reads the
  status word; a wait that ran out of spins sleeps on the doorbell under the
  deadline and the half is launched again (finished programs skip);
- `capturable=True` (CUDA graphs): one launch per half, waits bounded by
  `max_spins`; nothing is read until `check()`. The epochs are the device's own
  count of calls, advanced in the stream (`_epoch`).

Legend: see `ubep.layout`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ubep.calls import CallId
from ubep.protocols.base import CODE_RANGE, DTYPE_CODES, Received, SendPlan
from ubep.protocols.combine.triton_driver import ROWS_PER_PROGRAM, TOKENS_PER_PROGRAM, NormalTriton
from ubep.protocols.device_halves import TL_WORDS, cdiv, pow2
from ubep.protocols.ubep import status as ubep_status
from ubep.protocols.ubep import triton_halves as k
from ubep.results import DispatchHandle, RecvRoute


class UbepTriton(NormalTriton):
    """UBEP dispatch/combine on a heap with an address table, each call half one Triton kernel."""

    def dispatch_error(self, call: CallId, phase: str, code: int, words, mine: tuple) -> Exception:
        return ubep_status.error(self.t, self.blocks, call, code, words, *mine)

    # -- dispatch ---------------------------------------------------------------------------------

    def dispatch_send(
        self, call: CallId, plan: SendPlan, handle: DispatchHandle | None
    ) -> Callable[[], Received]:
        """The send half (one launch); returns the receive halves (routes, then gather), which a caller
        running several ranks on one stream calls after every rank's send. With plan.layout_by_send
        the launch checks topk_idx's values and fills the plan's layout (`layout_by_send`)."""
        s, R, dev = self.sizing, self.R, self.device
        x_NH, cached = plan.x_NH, handle is not None
        N, code = x_NH.shape[0], DTYPE_CODES[x_NH.dtype]
        K = 0 if cached else plan.topk_idx_NK.shape[1]
        epochs, mine = self._epoch(call), (x_NH.dtype, K, 0)
        rows_NB = x_NH.contiguous().view(torch.uint8)  # [N, H * itemsize]
        dtype, size = self._word(rows_NB.shape[1])
        fp8 = plan.scales_NS is not None
        scales = plan.scales_NS.view(torch.int32) if fp8 else self._zeros(N, 0, dtype=torch.int32)
        topk = plan.topk_idx_NK if not cached else self._zeros(N, 0)
        weights = plan.topk_weights_NK if not cached else self._zeros(N, 0, dtype=torch.float32)
        routed = plan.layout_by_send and not cached
        counts = plan.send_counts_R if routed else plan.send_counts_R.to(dev)
        announced = self.faults.count("dispatch.count", call, N) if self.faults.armed else N
        programs = R + cdiv(N, TOKENS_PER_PROGRAM)
        args = (
            self.table, self.me, epochs, rows_NB.view(dtype), rows_NB.shape[1] // size, scales,
            scales.shape[1], topk, weights, N, K, plan.is_token_in_rank_NR.view(torch.uint8), counts,
            self.owner_E, s.placement.num_experts, R, announced, code, s.max_topk, s.capacity, self._zeros(1),
            programs, self._zeros(8),
        )  # fmt: skip
        consts = dict(WORD=TL_WORDS[dtype], NB=TOKENS_PER_PROGRAM, KB=pow2(K, 2), RB=pow2(R + 1, 2), WB=128,
                      ROUTED=routed)  # fmt: skip
        try:
            self._once(call, "dispatch (input)", k.ubep_dispatch_send_kernel, (programs,), args, consts, mine)
        finally:
            self._wake()  # a rejected call's header is stamped too: peers asleep learn of it
        if self.faults.armed:
            self.faults.at("dispatch.sent", call)
        return lambda: self._receive(call, epochs, plan, handle, dtype, mine)

    def _receive(self, call: CallId, epochs: torch.Tensor, plan: SendPlan, handle, dtype, mine) -> Received:
        """The receive halves of a dispatch whose send half ran: routes, the receive size, gather."""
        s, R, dev = self.sizing, self.R, self.device
        x_NH, cached = plan.x_NH, handle is not None
        H, code, K = x_NH.shape[1], DTYPE_CODES[x_NH.dtype], mine[1]
        counts_R, sent_R, routes = self._zeros(R), self._zeros(R), self._zeros(R + 1)
        prefix_R1 = handle.recv.prefix_R1 if cached else self._zeros(R + 1)
        worst = handle.padded_to if cached else plan.num_worst_tokens  # a cached dispatch pads as its handle
        args = (
            self.table, self._live(), self.me, epochs, R, code, K, s.max_topk, s.capacity, *CODE_RANGE,
            counts_R, sent_R, prefix_R1, worst, routes, self._zeros(8), self.max_spins,
        )  # fmt: skip
        consts = dict(CACHED=cached, RB=pow2(R + 1, 2))
        self._half(call, "dispatch (routing)", k.ubep_dispatch_routes_kernel, (1,), args, consts, mine)
        M = self._received_rows(handle, worst, prefix_R1)
        fill = torch.zeros if worst else torch.empty  # padding rows stay 0
        recv_x_MH = fill(M, H, dtype=x_NH.dtype, device=dev)
        recv_scales_MS = None if plan.scales_NS is None else fill(M, plan.scales_NS.shape[1], device=dev)
        if cached:
            src_token_M, src_rank_M = handle.recv.src_token_M, handle.recv.src_rank_M
            recv_idx_MK = recv_w_MK = None
        else:
            src_token_M = torch.full((M,), -1, dtype=torch.int64, device=dev)
            src_rank_M = torch.full((M,), -1, dtype=torch.int64, device=dev)
            recv_idx_MK = torch.full((M, K), -1, dtype=torch.int64, device=dev)
            recv_w_MK = torch.zeros(M, K, dtype=torch.float32, device=dev)
        x_MB = recv_x_MH.view(torch.uint8).view(dtype)
        scales_MS = self._zeros(M, 0, dtype=torch.int32) if recv_scales_MS is None else recv_scales_MS
        blocks = cdiv(s.capacity, ROWS_PER_PROGRAM)
        args = (
            self.table, self._live(), self.me, epochs, R, s.capacity, s.max_topk, s.placement.num_experts,
            routes, counts_R, sent_R, prefix_R1, self.local_of_E, K,
            recv_idx_MK if recv_idx_MK is not None else self._zeros(0, 0),
            recv_w_MK if recv_w_MK is not None else self._zeros(0, 0, dtype=torch.float32),
            src_token_M, src_rank_M, x_MB, x_MB.shape[1], scales_MS.view(torch.int32), scales_MS.shape[1],
            self._zeros(R, blocks), blocks, self._zeros(8), self.max_spins,
        )  # fmt: skip
        consts = dict(WORD=TL_WORDS[dtype], IB=ROWS_PER_PROGRAM, KB=pow2(K, 2), WB=128)
        self._half(call, "dispatch (tokens)", k.ubep_dispatch_gather_kernel, (R, blocks), args, consts, mine)
        self.t.check_member("dispatch")  # what was read above was whole
        route = handle.recv if cached else RecvRoute(src_token_M, prefix_R1, src_rank_M)
        return Received(recv_x_MH, recv_idx_MK, recv_w_MK, route, recv_scales_MS)

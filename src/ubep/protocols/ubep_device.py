"""The UBEP protocol on Triton call halves: each half one kernel launch over the heap's address table
(`ubep.engine.ubep_triton`), its status turned into the exceptions of `ubep.protocols.ubep`.

    dispatch: send (lists, rows, stamps) -> routes (waits, checks, counts, prefix)
              -> [recv size: num_worst_tokens, the handle's, or ONE count read on the host]
              -> gather ((source, row block) programs: local top-k, rows as each source lands)
    combine:  send (rows, weights, header, stamp) -> reduce (token programs: waits, checks, sums)

The kernels keep `ubep.engine.ubep_halves`' memory layout word for word, so the
numba halves, these and the torch statement agree bit for bit. Every count,
position and check is computed on the device; nothing in a half reads device
memory on the host. The receive size is the one exception, and only without
`num_worst_tokens`: the rows a dispatch receives decide recv_x's shape, so the
host reads that one count (prefix[R]) between the routes and the gather. With
`num_worst_tokens` the outputs have that many rows (the padding: recv_x 0,
recv_topk_idx -1, recv_topk_weights 0, src_token and src_rank -1), and a
dispatch + combine reads nothing on the host. A cached dispatch takes its size
from the handle.

Two ways to run, as `ubep.protocols.ll_device`:
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
from ubep.engine import ubep_triton as k
from ubep.faults import FaultPoints
from ubep.protocols import ubep_status
from ubep.protocols.base import CODE_RANGE, DTYPE_CODES, Received, SendPlan, Sizing
from ubep.protocols.device_halves import TL_WORDS, WORDS, DeviceHalves, cdiv, pow2
from ubep.results import DispatchHandle, RecvRoute

ROWS_PER_PROGRAM, TOKENS_PER_PROGRAM = 16, 64  # rows a gather or combine-send program moves; send tokens
KINDS = {"dispatch": 1, "combine": 2}  # the device's call counters: [0] every call, [1], [2] each kind's


class UbepDevice(DeviceHalves):
    """UBEP dispatch/combine on a heap with an address table, each call half one Triton kernel."""

    REDUCE_PHASE = "combine"  # the home's wait, as the protocol names it
    layout_by_send = True  # the first kernel derives the layout from topk_idx (`SendPlan.layout_by_send`)
    WAITING = k.WAITING_WORD.value

    def __init__(
        self,
        heap,
        blocks,
        sizing: Sizing,
        faults: FaultPoints,
        local_of_E: torch.Tensor,
        engine,
        capturable: bool = False,
        max_spins: int | None = None,
    ):
        super().__init__(heap, blocks, engine, capturable, max_spins)
        self.sizing, self.faults = sizing, faults
        self.local_of_E = local_of_E.to(torch.int64).to(self.device)  # local id here, -1 elsewhere
        self.owner_E = sizing.placement.rank_of_expert_E.to(self.device)  # int64 [E]: each expert's rank
        self._calls = self._zeros(3)  # capturable: calls so far (all, dispatches, combines), on the device
        self._issued = [0, 0, 0]  # capturable: the host's seq and kinds' parities the device last took
        self._live()

    # -- launching --------------------------------------------------------------------------------

    def _epoch(self, call: CallId) -> torch.Tensor:
        """int64 [1] on the device: the call's exact epoch (2 seq + its kind's parity, `CallId.exact`).
        Not capturable: the host's. Capturable: from the device's own count of calls, advanced in the
        stream, so that every replay of a captured graph is the next call. The advance is what brings
        the device to the host's call: one call, or more where calls were rejected before reaching it."""
        call = call.exact()  # (an exact call is its own exact form)
        if not self.capturable:
            return torch.tensor([call.epoch], dtype=torch.int64).to(self.device)
        kind, parity = KINDS[call.kind], call.parity
        self._calls[0].add_(call.seq - self._issued[0])
        self._calls[kind].add_(1 if parity != self._issued[kind] else 2)  # only the parity counts
        self._issued[0], self._issued[kind] = call.seq, parity
        return (self._calls[0:1] * 2 + self._calls[kind : kind + 1] % 2).clone()

    def _error(self, call: CallId, phase: str, code: int, words, mine: tuple) -> Exception:
        """The exception for an error status (`ubep_status`, the numba halves' words)."""
        return ubep_status.error(self.t, self.blocks, call, code, words, *mine)

    @staticmethod
    def _word(*widths: int) -> tuple[torch.dtype, int]:
        """The widest word (dtype, bytes) dividing every width in bytes."""
        size = next(s for s in WORDS if all(w % s == 0 for w in widths))
        return WORDS[size], size

    @staticmethod
    def _received_rows(handle: DispatchHandle | None, worst: int, prefix_R1: torch.Tensor) -> int:
        """Rows of a dispatch's outputs: a cached dispatch's handle's (its padding too), else
        num_worst_tokens, else the one host read: the rows received (prefix_R1[R], on the device)."""
        if handle is not None:
            return handle.recv.src_token_M.shape[0]
        return worst or int(prefix_R1[-1])

    # -- dispatch ---------------------------------------------------------------------------------

    def dispatch(self, call: CallId, plan: SendPlan, handle: DispatchHandle | None) -> Received:
        """One dispatch. plan.num_worst_tokens > 0 (or a handle padded to it): every output has that many
        rows and nothing is read on the host; a rank that receives more raises ValueError."""
        return self.dispatch_send(call, plan, handle)()

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

    # -- combine ----------------------------------------------------------------------------------

    def combine(self, call: CallId, x_MH: torch.Tensor, handle: DispatchHandle, topk_weights_MK):
        """(combined [N, H] in x's dtype, summed weights float32 [N, K] or None). x_MH may be padded
        (num_worst_tokens): only the rows the dispatch received are sent."""
        return self.combine_send(call, x_MH, handle, topk_weights_MK)()

    def combine_send(
        self, call: CallId, x_MH: torch.Tensor, handle: DispatchHandle, topk_weights_MK
    ) -> Callable[[], tuple[torch.Tensor, torch.Tensor | None]]:
        """The send half (one launch); returns the reduce half."""
        epochs = self._epoch(call)
        self.send_back(call, epochs, x_MH, handle, topk_weights_MK)
        if self.faults.armed:
            self.faults.at("combine.mid", call)
        return lambda: self.reduce_home(call, epochs, x_MH, handle, topk_weights_MK)

    def send_back(
        self, call: CallId, epochs: torch.Tensor, x_MH: torch.Tensor, handle: DispatchHandle, topk_weights_MK
    ) -> None:
        """An expert rank's half of combine: its output rows and weights out once, then the stamp."""
        s, R = self.sizing, self.R
        M = x_MH.shape[0]
        rows_MB = x_MH.contiguous().view(torch.uint8)  # [M, H * itemsize]
        dtype, size = self._word(rows_MB.shape[1])
        K = 0 if topk_weights_MK is None else topk_weights_MK.shape[1]
        weights = self._zeros(M, 0, dtype=torch.float32) if K == 0 else topk_weights_MK.contiguous()
        programs = max(cdiv(M, ROWS_PER_PROGRAM), 1)
        self.engine.launch(
            k.ubep_combine_send_kernel, (programs,),
            self.table, self.me, epochs, rows_MB.view(dtype), rows_MB.shape[1] // size, weights, K,
            s.max_topk, handle.recv.prefix_R1, R, handle.seq, DTYPE_CODES[x_MH.dtype], self._zeros(1),
            programs, WORD=TL_WORDS[dtype], IB=ROWS_PER_PROGRAM, KB=pow2(K, 2), RB=pow2(R + 1, 2), WB=128,
        )  # fmt: skip
        self._wake()

    def reduce_home(
        self, call: CallId, epochs: torch.Tensor, x_MH: torch.Tensor, handle: DispatchHandle, weights_MK
    ):
        """The home's half of combine (after `send_back` of the same call, with its epochs)."""
        s, R, dev = self.sizing, self.R, self.device
        K = 0 if weights_MK is None else weights_MK.shape[1]
        N, H, dtype = handle.num_tokens, x_MH.shape[1], x_MH.dtype
        in_rank_NR = handle.is_token_in_rank_NR.view(torch.uint8)
        sent_NR = in_rank_NR.to(torch.int64)
        place_NR = torch.cumsum(sent_NR, 0) - sent_NR  # t's row among the rows sent to each rank
        out_NH = torch.empty(N, H, dtype=dtype, device=dev)
        bf16 = dtype == torch.bfloat16  # else float32: the payloads a Buffer accepts
        sums_NH = out_NH.view(torch.int16) if bf16 else out_NH
        out_NK = self._zeros(N, K, dtype=torch.float32)
        args = (
            self.table, self._live(), self.me, epochs, R, N, in_rank_NR, place_NR,
            handle.send_counts_R.to(dev), handle.seq, DTYPE_CODES[dtype], *CODE_RANGE, K, s.max_topk,
            R * s.capacity, sums_NH, H, out_NK, self._zeros(max(N, 1)), self._zeros(8), self.max_spins,
        )  # fmt: skip
        kind = k.BF16 if bf16 else k.F32
        consts = dict(KIND=kind, RB=pow2(R + 1, 2), KB=pow2(K, 2), HB=pow2(H, 16, 256))
        mine = (dtype, K, handle.seq)
        self._half(call, self.REDUCE_PHASE, k.ubep_combine_reduce_kernel, (max(N, 1),), args, consts, mine)
        self.t.check_member("combine")  # what was read above was whole
        return out_NH, (out_NK if K else None)

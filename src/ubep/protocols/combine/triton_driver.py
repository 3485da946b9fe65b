"""What the Triton halves of normal mode's protocols share on the host: the device's own count of
calls (capturable epochs), the receive size, and the combine's two halves, which ubep runs as they are
and bsp between its barriers.

    combine: send (rows, weights, header, stamp) -> reduce (token programs: waits, checks, sums)

The kernels are `ubep.protocols.combine.triton_halves`, over the combine's own address table
(`BackBlocks.table()`, on the device), built once with the Buffer. Launching, relaunching and
`check()` are `ubep.protocols.device_halves`'.

Legend: see `ubep.layout`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ubep.calls import CallId
from ubep.faults import FaultPoints
from ubep.protocols.base import CODE_RANGE, DTYPE_CODES, Received, SendPlan, Sizing
from ubep.protocols.combine import triton_halves as k
from ubep.protocols.combine.status import combine_error
from ubep.protocols.device_halves import TL_WORDS, WORDS, DeviceHalves, cdiv, pow2
from ubep.results import DispatchHandle

ROWS_PER_PROGRAM, TOKENS_PER_PROGRAM = 16, 64  # rows a gather or combine-send program moves; send tokens
KINDS = {"dispatch": 1, "combine": 2}  # the device's call counters: [0] every call, [1], [2] each kind's


class NormalTriton(DeviceHalves):
    """A normal-mode protocol on a heap with an address table, each call half one Triton kernel. A
    subclass issues its dispatch (`dispatch_send`, returning the receive halves) and turns its
    dispatch kernels' errors into exceptions (`dispatch_error`)."""

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
        self.back = blocks.back
        back_table, _ = heap.address_table(self.back.table())
        self.back_table = torch.from_numpy(back_table).to(self.device)  # the combine's own table
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
            return torch.tensor([call.epoch], dtype=torch.int64, device="cpu").to(self.device)
        kind, parity = KINDS[call.kind], call.parity
        self._calls[0].add_(call.seq - self._issued[0])
        self._calls[kind].add_(1 if parity != self._issued[kind] else 2)  # only the parity counts
        self._issued[0], self._issued[kind] = call.seq, parity
        return (self._calls[0:1] * 2 + self._calls[kind : kind + 1] % 2).clone()

    def _error(self, call: CallId, phase: str, code: int, words, mine: tuple) -> Exception:
        """The exception for an error status, in the numba halves' words: the combine's here, a
        dispatch's in the subclass (`dispatch_error`)."""
        if call.kind == "combine":
            return combine_error(self.t, self.back, call, code, words, *mine)
        return self.dispatch_error(call, phase, code, words, mine)

    def dispatch_error(self, call: CallId, phase: str, code: int, words, mine: tuple) -> Exception:
        """The exception for a dispatch half's error status (`mine`: this rank's dtype, top-k...)."""
        raise NotImplementedError

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
        """The send half; returns the receive halves, which a caller running several ranks on one
        stream calls after every rank's send."""
        raise NotImplementedError

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
            k.combine_send_kernel, (programs,),
            self.back_table, self.me, epochs, rows_MB.view(dtype), rows_MB.shape[1] // size, weights, K,
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
            self.back_table, self._live(), self.me, epochs, R, N, in_rank_NR, place_NR,
            handle.send_counts_R.to(dev), handle.seq, DTYPE_CODES[dtype], *CODE_RANGE, K, s.max_topk,
            R * s.capacity, sums_NH, H, out_NK, self._zeros(max(N, 1)), self._zeros(8), self.max_spins,
        )  # fmt: skip
        kind = k.BF16 if bf16 else k.F32
        consts = dict(KIND=kind, RB=pow2(R + 1, 2), KB=pow2(K, 2), HB=pow2(H, 16, 256))
        mine = (dtype, K, handle.seq)
        self._half(call, self.REDUCE_PHASE, k.combine_reduce_kernel, (max(N, 1),), args, consts, mine)
        self.t.check_member("combine")  # what was read above was whole
        return out_NH, (out_NK if K else None)

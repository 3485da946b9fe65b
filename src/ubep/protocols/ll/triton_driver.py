"""Low-latency mode on Triton call halves: each send and receive half one kernel launch over the
heap's address table (`ubep.protocols.ll.triton_halves`), its status turned into the torch
statement's exceptions.

    dispatch_send: one launch, (R, L) programs: reuse waits, puts, counts, stamps
                   -> receive half: one launch, (L, R) programs: waits, checks, placement
    combine_send:  one launch, (R, L) programs: reuse waits, puts, stamps
                   -> receive half: one launch, N programs: waits, checks, weighted sums

Every count, position and check is computed in the kernels from device tensors;
nothing in a half reads device memory on the host. Two ways to run:
- `capturable=False` (tests, the interpreter): after each launch the host reads
  the status word; a wait that ran out of spins sleeps on the doorbell under the
  deadline, and the half is launched again (it resumes where it stopped);
- `capturable=True` (CUDA graphs): one launch per half, waits bounded by
  `max_spins`; nothing is read until `check()`, which turns the status words of
  the calls since the last check into the same exceptions (a wait that ran out
  is a CommTimeoutError naming the peer). The epochs are the device's own count
  of calls of each kind, advanced in the stream, so each replay of a captured
  graph is the next call (every rank must replay the same calls).

Rows travel in one of the two data-as-flag forms (`flag`, docs/device.md):
- "after-data" (default): rows, then the record's stamp (a system-scope release) that covers them;
- "in-word": every 4 bytes of a row as an 8-byte word with the epoch in its high half, each word
  its own flag (the receiver polls the words it reads; records keep their stamp). Slot rows take
  twice the bytes (`LLBlocks.of(..., in_word=True)`).

This rank's own inputs are checked in the send kernels (topk_idx's values and repeats; in combine,
the handle's dispatch received and the same topk_idx): the host reads none of their values, and a
bad one raises the host's exception after the launch (or at `check()`).

`LLExchange` keeps the reuse words' Python side (`abort`, `resume`) and delegates here
for engine="triton" on a heap with an address table.

Legend: see `ubep.protocols.ll.plans`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ubep.calls import CallId
from ubep.protocols.base import CODE_DTYPES, CODE_RANGE, DTYPE_CODES, Sizing
from ubep.protocols.device_halves import TL_WORDS, WORDS, DeviceHalves, pow2
from ubep.protocols.ll import status as ll_status
from ubep.protocols.ll import triton_halves as k
from ubep.protocols.ll.blocks import COMBINE, DISPATCH
from ubep.protocols.ll.plans import FLAGS, IN_WORD, LLCombinePlan, LLDispatchOut, LLDispatchPlan, per_writer


class LLTriton(DeviceHalves):
    """Low-latency halves on a heap as Triton kernels; `release(call, kind)` is the exchange's Python
    release of a half (on every failure after the send)."""

    WAITING = k.WAITING_WORD.value

    def __init__(
        self,
        heap,
        blocks,
        sizing: Sizing,
        release: Callable[[CallId, int], None],
        engine,
        capturable: bool = False,
        max_spins: int | None = None,
        flag: str = FLAGS[0],
    ):
        if flag not in FLAGS:
            raise ValueError(f"flag must be one of {FLAGS}, got {flag!r}")
        if flag == IN_WORD and sizing.hidden % 2:
            raise ValueError(
                f"flag {IN_WORD!r} carries rows in 4-byte words: hidden must be even, got {sizing.hidden}"
            )
        self.flag, self.in_word = flag, flag == IN_WORD
        self.slot_bytes = sizing.row_bytes * (2 if self.in_word else 1)  # a slot row's stride
        super().__init__(heap, blocks, engine, capturable, max_spins)
        self.sizing, self.release = sizing, release
        p = sizing.placement
        L = p.num_local_experts
        experts_RL = torch.empty(self.R, L, dtype=torch.int64, device=p.rank_of_expert_E.device)
        experts_RL[p.rank_of_expert_E, p.local_index_E] = torch.arange(
            p.num_experts, dtype=torch.int64, device=p.rank_of_expert_E.device
        )
        self.experts_RL = experts_RL.to(self.device)
        self.owner_E = p.rank_of_expert_E.to(torch.int64).to(self.device)
        self.local_E = p.local_index_E.to(torch.int64).to(self.device)
        self._epochs = self._zeros(2, 1)  # capturable: the calls of each kind so far (the device's epochs)
        self._issued = [0, 0]  # capturable: the host's epoch of the last call the device counted, per kind
        self._live()  # built here: a call copies nothing to the device unless ranks were masked since

    # -- launching --------------------------------------------------------------------------------

    def _error(self, call: CallId, phase: str, code: int, words, mine: int) -> Exception:
        """The exception for an error status (`ll_status`, the CPU protocol's words)."""
        return ll_status.error(self.t, self.blocks, call, phase, code, words, mine)

    def _epoch(self, call: CallId, kind: int) -> torch.Tensor:
        """int64 [1] on the device: the epoch both halves of this call read. Not capturable: the host's
        (`call.epoch`). Capturable: the device's own count of calls of this kind, advanced in the
        stream, so that every replay of a captured graph is a new call; a copy is taken for the
        receive half, which may run after the next send."""
        if not self.capturable:
            return torch.tensor([call.epoch], dtype=torch.int64, device="cpu").to(self.device)
        self._epochs[kind].add_(1)
        self._issued[kind] = call.epoch if call is not None else self._issued[kind] + 1
        return self._epochs[kind].clone()

    def restart(self, seq: int) -> None:
        """Capturable: every kind's next call is seq + 1 (the host's `CallCounter.resume`, after a mask)."""
        self._epochs.fill_(seq)
        self._issued = [seq, seq]

    def skip(self, call: CallId, kind: int) -> None:
        """Capturable: a call rejected before its send still takes its epoch on the device, so that the
        device's count of calls stays the host's (eagerly; a graph's replays advance only the device's)."""
        if self.capturable and call.epoch > self._issued[kind]:
            self._epochs[kind].add_(call.epoch - self._issued[kind])
            self._issued[kind] = call.epoch

    def _word(self, *widths: int) -> tuple[torch.dtype, int]:
        """The widest word (dtype, bytes) dividing every width in bytes and the slots' row stride; in
        word form 4-byte payloads (every width is a multiple of 4 there: even hidden, FP8's H % 128)."""
        if self.in_word:
            return torch.int32, 4
        size = next(s for s in WORDS if all(w % s == 0 for w in (*widths, self.sizing.row_bytes)))
        return WORDS[size], size

    # -- dispatch ---------------------------------------------------------------------------------

    def dispatch_send(self, call: CallId, plan: LLDispatchPlan, out: LLDispatchOut) -> Callable[[], None]:
        return self.dispatch_rows(call, plan.rows_NB, plan.code, plan.max_tokens, out)

    def dispatch_rows(
        self, call: CallId, rows_NB: torch.Tensor, code: int, T: int, out: LLDispatchOut
    ) -> Callable[[], None]:
        """Send half: rows_NB uint8 [N, b] (the tokens in wire form) to every expert their
        topk_idx (out.handle's) selects; returns the receive half."""
        s, topk, epochs = self.sizing, out.handle.topk_idx_NK, self._epoch(call, DISPATCH)
        N, b = rows_NB.shape
        dtype, size = self._word(b, *(hi - lo for _, lo, hi in out.planes))
        L = s.placement.num_local_experts
        args = (
            self.table, self._live(), self.me, epochs, rows_NB.view(dtype), topk, N,
            topk.shape[1], s.placement.num_experts, self.experts_RL, L, code, T, s.max_topk, s.capacity,
            s.row_bytes // size, self.slot_bytes, b // size, b, self._zeros(self.R), self._zeros(self.R, L),
            self._zeros(8), self.max_spins,
        )  # fmt: skip
        consts = dict(WORD=TL_WORDS[dtype], IN_WORD=self.in_word, NB=pow2(N, 16, 64),
                      KB=pow2(topk.shape[1], 2), WB=128)  # fmt: skip
        self._half(call, "low-latency dispatch (buffer reuse)", k.ll_dispatch_send_kernel, (self.R, L),
                   args, consts, T)  # fmt: skip
        self._wake()
        return lambda: self._receive_tokens(call, epochs, out, dtype, size)

    def _receive_tokens(
        self, call: CallId, epochs: torch.Tensor, out: LLDispatchOut, dtype: torch.dtype, size: int
    ) -> None:
        s, h = self.sizing, out.handle
        planes = [plane.view(dtype) for plane, _, _ in out.planes]
        plane1 = planes[1] if len(planes) > 1 else planes[0][:, :, :0]
        L, M, W0 = planes[0].shape
        T = h.num_max_dispatch_tokens_per_rank
        args = (
            self.table, self._live(), self.me, epochs, self.R, L, out.code, T,
            s.max_topk, s.capacity, s.row_bytes // size, self.slot_bytes, s.row_bytes, out.row_width,
            *CODE_RANGE,
            planes[0], W0, plane1, plane1.shape[2], M, h.recv_src_token_LM, h.recv_src_rank_LM,
            h.recv_src_k_LM, h.layout_range_LR2, h.recv_count_L, self._zeros(L, self.R), self._zeros(1),
            self._zeros(8), self.max_spins,
        )  # fmt: skip
        consts = dict(WORD=TL_WORDS[dtype], IN_WORD=self.in_word, LB=pow2(L, 2), IB=16, WB=128)
        try:
            phase = "low-latency dispatch (tokens)"
            self._half(call, phase, k.ll_dispatch_recv_kernel, (L, self.R), args, consts, T)
        except BaseException:
            h.recv_count_L.fill_(-1)  # not received
            self.release(call, DISPATCH)
            raise
        self._wake()

    # -- combine ----------------------------------------------------------------------------------

    def combine_send(self, call: CallId, plan: LLCombinePlan, out_NH: torch.Tensor) -> Callable[[], None]:
        x_LMH = plan.x_LMB.view(CODE_DTYPES[plan.code])
        return self.combine_rows(call, x_LMH, plan.topk_weights_NK, plan.handle, out_NH)

    def combine_rows(
        self,
        call: CallId,
        x_LMH: torch.Tensor,
        weights_NK: torch.Tensor,
        handle,
        out_NH: torch.Tensor,
        topk_NK: torch.Tensor | None = None,
    ) -> Callable[[], None]:
        """Send half: every row the dispatch of `handle` delivered, x_LMH [L, M, H] (bf16 or fp32), back
        to its home; returns the receive half, which sums them into out_NH with weights_NK. topk_NK
        (int64, the handle's shape): the combine's topk_idx, which the kernel checks is the dispatch's."""
        s, h, code, epochs = self.sizing, handle, DTYPE_CODES[x_LMH.dtype], self._epoch(call, COMBINE)
        x_LMB = x_LMH.contiguous().view(torch.uint8)
        L, M, B = x_LMB.shape
        dtype, size = self._word(B)
        topk = h.topk_idx_NK
        N, K = topk.shape
        args = (
            self.table, self._live(), self.me, epochs, x_LMB.view(dtype), L, M,
            B // size, h.layout_range_LR2, self.R, per_writer(s), s.row_bytes // size, code,
            topk, topk if topk_NK is None else topk_NK, N, K, h.recv_count_L,
            self._zeros(self.R), self._zeros(self.R, L), self._zeros(8), self.max_spins,
        )  # fmt: skip
        consts = dict(WORD=TL_WORDS[dtype], IN_WORD=self.in_word, LB=pow2(L, 2), RB=pow2(self.R, 2),
                      NB=pow2(N, 16, 64), KB=pow2(K, 2), IB=16, WB=128)  # fmt: skip
        self._half(call, "low-latency combine (buffer reuse)", k.ll_combine_send_kernel, (self.R, L), args,
                   consts, code)  # fmt: skip
        self._wake()
        return lambda: self._reduce(call, epochs, code, h.topk_idx_NK, weights_NK, out_NH)

    def return_slots(
        self, topk: torch.Tensor, owner_NK: torch.Tensor, expected_R: torch.Tensor
    ) -> torch.Tensor:
        """int64 [N, K]: the back slot of each y(t, k) (-1 where topk is). Expert rank r returns its
        rows in its own run (r * per_writer onwards), ordered by (local expert, token); tensor
        operations only, so nothing is read back on the host."""
        N, K = topk.shape
        valid = topk >= 0
        local_NK = self.local_E[topk.clamp(min=0)]
        L = self.sizing.placement.num_local_experts
        t_NK = torch.arange(N, dtype=torch.int64, device=topk.device).unsqueeze(1).expand(N, K)
        key = torch.where(valid, (owner_NK * L + local_NK) * max(N, 1) + t_NK, torch.iinfo(torch.int64).max)
        place = torch.empty(N * K, dtype=torch.int64, device=topk.device)
        place[torch.argsort(key.flatten())] = torch.arange(  # valid ones first
            N * K, dtype=torch.int64, device=topk.device
        )
        start_R = torch.cumsum(expected_R, 0) - expected_R  # where each owner's pairs begin
        slot = owner_NK * per_writer(self.sizing) + place.view(N, K) - start_R[owner_NK]
        return torch.where(valid, slot, -1)

    def _reduce(
        self,
        call: CallId,
        epochs: torch.Tensor,
        code: int,
        topk: torch.Tensor,
        weights_NK: torch.Tensor,
        out_NH: torch.Tensor,
    ) -> None:
        s = self.sizing
        N, K = topk.shape
        # values the dispatch's kernel rejected (outside [-1, E)) must not index the tables: that call
        # failed (its error comes first), and this one only has to stop without a fault
        topk = torch.where((topk >= -1) & (topk < s.placement.num_experts), topk, -1)
        valid = (topk >= 0).to(torch.int64)
        owner_NK = self.owner_E[topk.clamp(min=0)]
        expected_R = self._zeros(self.R).scatter_add_(0, owner_NK.flatten(), valid.flatten())
        slots_NK = self.return_slots(topk, owner_NK, expected_R)
        out = out_NH.view(torch.int16) if out_NH.dtype == torch.bfloat16 else out_NH
        args = (
            self.table, self.me, epochs, topk, K, self.owner_E, expected_R,
            weights_NK, code, *CODE_RANGE, s.capacity * s.max_topk, slots_NK, self.slot_bytes,
            out, s.hidden, self._zeros(max(N, 1)), self._zeros(1), N, self._zeros(8), self.max_spins,
        )  # fmt: skip
        consts = dict(
            Y_BF16=code == DTYPE_CODES[torch.bfloat16], IN_WORD=self.in_word, HB=pow2(s.hidden, 16, 256)
        )
        try:
            if N:
                self._half(call, "low-latency combine", k.ll_combine_recv_kernel, (N,), args, consts, code)
            else:
                self.release(call, COMBINE)  # no token, no wait: the half is free at once
        except BaseException:
            self.release(call, COMBINE)
            raise
        self._wake()

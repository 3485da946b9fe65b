"""What the compiled (numba) halves of normal mode's protocols share on the host: entering a half until
it is done and turning its status into exceptions, and the combine's two halves, which ubep runs as
they are and bsp between its barriers.

    combine: send_back (rows, weights, header, stamp) -> reduce_home (wait, check, sum in rank order)

The halves are `ubep.protocols.combine.numba_halves`, over the combine's own address table
(`BackBlocks.table()`), built once with the Buffer.

Legend: see `ubep.layout`.
"""

from __future__ import annotations

import numpy as np
import torch

from ubep.calls import CallId
from ubep.engine.numba_engine import tensors
from ubep.faults import FaultPoints
from ubep.protocols import halves
from ubep.protocols.base import CODE_RANGE, DTYPE_CODES, Sizing
from ubep.protocols.combine import numba_halves as k
from ubep.protocols.combine.status import combine_error
from ubep.results import DispatchHandle
from ubep.transport.heap import Heap

NO_I64 = np.empty((0, 0), dtype=np.int64)  # an absent int64 [N, K] (cached dispatch: no top-k)
NO_F32 = np.empty((0, 0), dtype=np.float32)  # an absent float32 [N, K] or [M, S]


def bits_of(t: torch.Tensor) -> np.ndarray:
    """A float tensor as numpy elements numba reduces: float32 itself, bf16 as uint16 bits."""
    return t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


class NormalNumba(halves.HeapHalves):
    """A normal-mode protocol on a heap, each call half one compiled function. A subclass runs its
    dispatch and turns its dispatch halves' errors into exceptions (`dispatch_error`)."""

    def __init__(self, heap: Heap, blocks, sizing: Sizing, faults: FaultPoints):
        super().__init__(heap, blocks)
        self.sizing, self.faults = sizing, faults
        self.back = blocks.back
        self.back_table, _ = heap.address_table(self.back.table())

    def dispatch_error(self, call: CallId, code: int, status: np.ndarray, mine: tuple) -> Exception:
        """The exception for a dispatch half's error status (`mine`: this rank's dtype, top-k, seq)."""
        raise NotImplementedError

    def _enter(self, call: CallId, phase: str, mine: tuple, half, *args) -> None:
        """Run a resumable half to DONE, or raise its error; `mine` is (dtype, top-k, dispatch seq)
        of this rank's call, for the error's words."""
        code = halves.run(self.t, call, phase, half, *args)
        if code == k.DONE:
            return
        if call.kind == "combine":
            raise combine_error(self.t, self.back, call, code, args[-1], *mine)
        raise self.dispatch_error(call, code, args[-1], mine)

    def _back_memory(self, call: CallId) -> tuple:
        """What every combine half takes first: `_memory`'s, over the combine's own table."""
        return self.back_table, *self._memory(call)[1:]

    def send_back(self, call: CallId, x_MH: torch.Tensor, handle: DispatchHandle, topk_weights_MK) -> None:
        """An expert rank's half of combine: its output rows and weights out once, then the stamp."""
        weights = NO_F32 if topk_weights_MK is None else topk_weights_MK.numpy()
        times = call.timers
        if times is not None:
            times.lap("between")
        woken = k.combine_send(
            *self._back_memory(call), x_MH.view(torch.uint8).numpy(), weights, self.sizing.max_topk,
            handle.recv.prefix_R1.numpy(), handle.seq, DTYPE_CODES[x_MH.dtype], self.wake,
        )  # fmt: skip
        if woken:
            self.t.ring_marked(self.wake, times)
        if times is not None:
            times.lap("send")

    def reduce_home(self, call: CallId, phase: str, x_MH: torch.Tensor, handle: DispatchHandle, weights_MK):
        """The home's half of combine: (combined [N, H] in x's dtype, summed weights [N, K] or None)."""
        s, R = self.sizing, self.R
        K = 0 if weights_MK is None else weights_MK.shape[1]
        out_NH = torch.empty(handle.num_tokens, x_MH.shape[1], dtype=x_MH.dtype, device="cpu")
        out_w = NO_F32 if K == 0 else np.empty((handle.num_tokens, K), dtype=np.float32)  # wrapped, no copy
        pending, status = np.empty(R, dtype=np.int64), np.zeros(6, dtype=np.int64)
        self._enter(
            call, phase, (x_MH.dtype, K, handle.seq), k.combine_reduce, *self._back_memory(call),
            handle.is_token_in_rank_NR.view(torch.uint8).numpy(), handle.send_counts_R.numpy(), handle.seq,
            DTYPE_CODES[x_MH.dtype], *CODE_RANGE, s.max_topk, R * s.capacity, bits_of(out_NH), out_w,
            np.zeros(R, dtype=np.int64), pending, *self.budget, status,
        )  # fmt: skip
        self.t.check_member("combine")  # what was read above was whole
        return out_NH, None if K == 0 else tensors(out_w)[0]

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
from ubep.errors import PeerDataError
from ubep.faults import FaultPoints
from ubep.layout import prefix_offsets
from ubep.protocols import halves
from ubep.protocols.base import CODE_DTYPES, CODE_RANGE, DTYPE_CODES, Received, SendPlan, Sizing
from ubep.results import DispatchHandle, RecvRoute
from ubep.transport.heap import Heap, complaint

_NO_I64 = np.empty((0, 0), dtype=np.int64)
_NO_F32 = np.empty((0, 0), dtype=np.float32)


def bits_of(t: torch.Tensor) -> np.ndarray:
    """A float tensor as numpy elements numba reduces: float32 itself, bf16 as uint16 bits."""
    return t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


class UbepCompiled:
    """UBEP dispatch/combine on a heap, each call half one compiled function."""

    def __init__(
        self, heap: Heap, blocks, sizing: Sizing, faults: FaultPoints, local_of_expert_E: torch.Tensor
    ):
        self.t, self.blocks, self.sizing, self.faults = heap, blocks, sizing, faults
        self.me, self.R = heap.rank, heap.num_ranks
        self.table, self.asleep = heap.address_table(blocks.all())
        self.wake = np.zeros(self.R, dtype=np.uint8)
        self.local_of_expert = local_of_expert_E.numpy()

    def _enter(self, call: CallId, phase: str, mine: tuple, half, *args) -> None:
        """Run a resumable half to DONE, or raise its error; `mine` is (dtype, top-k, dispatch seq)
        of this rank's call, for the error's words."""
        code = halves.run(self.t, call, phase, half, *args)
        if code != k.DONE:
            raise self._error(call, code, args[-1], *mine)

    # -- dispatch ---------------------------------------------------------------------------------

    def dispatch(self, call: CallId, plan: SendPlan, handle: DispatchHandle | None) -> Received:
        s, t, R = self.sizing, self.t, self.R
        x_NH, half, epoch = plan.x_NH, call.epoch & 1, call.epoch
        N, H = x_NH.shape
        cached = handle is not None
        code = DTYPE_CODES[x_NH.dtype]
        scales = _NO_F32 if plan.scales_NS is None else plan.scales_NS.numpy()
        woken = k.dispatch_send(
            self.table,
            self.asleep,
            self.me,
            epoch,
            half,
            t.live_R,
            x_NH.view(torch.uint8).numpy(),
            scales,
            _NO_I64 if cached else plan.topk_idx_NK.numpy(),
            _NO_F32 if cached else plan.topk_weights_NK.numpy(),
            plan.is_token_in_rank_NR.view(torch.uint8).numpy(),
            plan.send_counts_R.numpy(),
            self.faults.count("dispatch.count", call, N),
            code,
            s.max_topk,
            s.capacity,
            self.wake,
        )
        if woken:
            t.ring_marked(self.wake)
        if self.faults.armed:
            self.faults.at("dispatch.sent", call)
        K = 0 if cached else plan.topk_idx_NK.shape[1]
        counts_R, sent_R = np.empty(R, dtype=np.int64), np.empty(R, dtype=np.int64)
        pending, status = np.empty(R, dtype=np.int64), np.zeros(6, dtype=np.int64)
        self._enter(
            call,
            "dispatch (routing)",
            (x_NH.dtype, K, 0),
            k.dispatch_routes,
            self.table,
            self.asleep,
            self.me,
            epoch,
            half,
            t.live_R,
            code,
            K,
            s.max_topk,
            s.capacity,
            *CODE_RANGE,
            np.zeros(R, dtype=np.int64),
            counts_R,
            sent_R,
            pending,
            *halves.BUDGET,
            status,
        )
        if cached:
            prefix_R1, src_token_M = handle.recv.prefix_R1, handle.recv.src_token_M
        else:
            prefix_R1 = prefix_offsets(torch.from_numpy(counts_R))
        M = int(prefix_R1[-1])
        if not cached:
            src_token_M = torch.empty(M, dtype=torch.int64)
        recv_x_MH = torch.empty(M, H, dtype=x_NH.dtype)
        recv_scales_MS = None if plan.scales_NS is None else torch.empty(M, plan.scales_NS.shape[1])
        recv_idx_MK = None if cached else torch.empty(M, K, dtype=torch.int64)
        recv_w_MK = None if cached else torch.empty(M, K, dtype=torch.float32)
        self._enter(
            call,
            "dispatch (tokens)",
            (x_NH.dtype, K, 0),
            k.dispatch_gather,
            self.table,
            self.asleep,
            self.me,
            epoch,
            half,
            t.live_R,
            prefix_R1.numpy(),
            counts_R,
            sent_R,
            s.capacity,
            s.max_topk,
            self.local_of_expert,
            _NO_I64 if cached else recv_idx_MK.numpy(),
            _NO_F32 if cached else recv_w_MK.numpy(),
            src_token_M.numpy(),
            recv_x_MH.view(torch.uint8).numpy(),
            _NO_F32 if recv_scales_MS is None else recv_scales_MS.numpy(),
            np.zeros(R + 1, dtype=np.int64),
            pending,
            *halves.BUDGET,
            status,
        )
        t.check_member("dispatch")  # what was read above was whole
        route = handle.recv if cached else RecvRoute.of(src_token_M, prefix_R1)
        return Received(recv_x_MH, recv_idx_MK, recv_w_MK, route, recv_scales_MS)

    # -- combine ----------------------------------------------------------------------------------

    def combine(self, call: CallId, x_MH: torch.Tensor, handle: DispatchHandle, topk_weights_MK):
        s, t, R = self.sizing, self.t, self.R
        half, epoch = call.epoch & 1, call.epoch
        code = DTYPE_CODES[x_MH.dtype]
        weights = _NO_F32 if topk_weights_MK is None else topk_weights_MK.numpy()
        woken = k.combine_send(
            self.table,
            self.asleep,
            self.me,
            epoch,
            half,
            t.live_R,
            x_MH.view(torch.uint8).numpy(),
            weights,
            s.max_topk,
            handle.recv.prefix_R1.numpy(),
            handle.seq,
            code,
            self.wake,
        )
        if woken:
            t.ring_marked(self.wake)
        if self.faults.armed:
            self.faults.at("combine.mid", call)
        N, H = handle.num_tokens, x_MH.shape[1]
        out_NH = torch.empty(N, H, dtype=x_MH.dtype)
        out_NK = None if topk_weights_MK is None else torch.empty(N, weights.shape[1], dtype=torch.float32)
        self._enter(
            call,
            "combine",
            (x_MH.dtype, weights.shape[1], handle.seq),
            k.combine_reduce,
            self.table,
            self.asleep,
            self.me,
            epoch,
            half,
            t.live_R,
            handle.is_token_in_rank_NR.view(torch.uint8).numpy(),
            handle.send_counts_R.numpy(),
            handle.seq,
            code,
            *CODE_RANGE,
            s.max_topk,
            R * s.capacity,
            bits_of(out_NH),
            _NO_F32 if out_NK is None else out_NK.numpy(),
            np.zeros(R, dtype=np.int64),
            np.empty(R, dtype=np.int64),
            *halves.BUDGET,
            np.zeros(6, dtype=np.int64),
        )
        t.check_member("combine")  # what was read above was whole
        return out_NH, out_NK

    # -- status words to exceptions ---------------------------------------------------------------

    def _error(self, call: CallId, code: int, status: np.ndarray, dtype, K: int, seq: int) -> PeerDataError:
        """The exception (in the torch statement's words) for a half's error status."""
        peer, a, b, c, d = (int(v) for v in status[1:6])
        if code == k.E_TOPK:
            return PeerDataError(f"dispatch: rank {peer} routed with top-k {a}, this rank with {K}")
        if code == k.E_FIELD:
            header = self.blocks.route if call.kind == "dispatch" else self.blocks.back.back
            return self.t.bad_data(call, peer, complaint(header, header.fields[b], peer, a))
        messages = {
            k.E_DTYPE: f"dispatch: rank {peer} sent {CODE_DTYPES.get(a)}, this rank {dtype}",
            k.E_LIST: f"dispatch: rank {peer} listed tokens outside [0, {a})",
            k.E_EXPERT: f"dispatch: rank {peer} routed to expert ids outside [-1, {a})",
            k.E_NONE_LOCAL: f"dispatch: rank {peer} listed a token for this rank that selects none "
            "of its experts",
            k.E_COUNT: f"dispatch: rank {peer} sends {a} rows here, this rank's handle expects {b} "
            "(all ranks must pass handles of the same dispatch)",
            k.E_SHORT: f"dispatch: rank {peer} sent {a} tokens, fewer than routed here",
            k.E_OTHER_CALL: f"combine: rank {peer} combines the rows of call #{a}, this rank those of #{seq} "
            "(all ranks must pass the handle of the same dispatch)",
            k.E_ROWS: f"combine: rank {peer} returned {a} rows of {CODE_DTYPES.get(b)} (top-k {c}), "
            f"expected {d} of {dtype} (top-k {K})",
        }
        return self.t.bad_data(call, peer, messages[code])

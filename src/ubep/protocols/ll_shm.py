"""Low-latency dispatch/combine on the shared-memory heap: puts into per-peer slots, data as flag.

Dispatch (call epoch e, half p = e % 2 of every double-buffered region):
  send half: for each destination d, copy the rows of every (token, expert on d)
    pair straight into d's slot for (local expert j, this rank), `ll.d{p}.x[j, me]`,
    with each row's (token, top-k slot) in `ll.d{p}.src`; then write this rank's
    header in d (the per-expert counts, dtype, T) and stamp it with e, last.
    The counts travel with the data: there is no count round and no barrier.
  receive half: for each source s in ascending order, wait for its stamp, then
    copy its rows into recv_x[j, begin : begin + count], where begin is the rows
    already placed for j by sources < s. Finally publish "dispatch e consumed".
Combine mirrors it: the expert rank puts each row y(t, k) into the home's slot
  `ll.c{p}.x[t * max_topk + k]`, then stamps its header in the home; the home
  waits for the stamps of the ranks it expects rows from and reduces over k.

Reuse argument (two outstanding calls, double buffering). The slots for call e
are reused by call e + 2. A sender writes call e + 2 into d only after reading
d's "consumed" word for that half (`ll.done[kind, p]`) at >= e, which d writes at
the end of its receive half of e, after its last read of those slots. So no
write of e + 2 lands under a read of e, whatever the order in which hooks run.
Stamps cannot be confused across calls either: a receiver waits for the exact
epoch, and each writer stamps e before e + 2 (program order; x86 keeps stores
in order). The wait is point to point and, when every rank runs a call's
receive half before sending the call after next (DeepEP's rule: at most two
low-latency calls of a kind in flight), never blocks on a rank that is itself
waiting: d's receive half of e needs only sends of e, all issued already.
A third send while this rank's own receive half of e is still pending would wait
on itself; it raises instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ubep.errors import PeerDataError
from ubep.protocols.base import CallId, ShmPeers, Sizing
from ubep.protocols.ll_base import (
    LLCombinePlan,
    LLDispatchOut,
    LLDispatchPlan,
    as_words,
    gather_rows,
    place_source,
    reduce_rows,
    returned_rows,
    slot_positions,
)
from ubep.shm import SegmentLayout
from ubep.waiting import AbortNotice, PeerAbortedError

# Dispatch header words (one row per source rank, in the receiver's segment).
D_FLAG, D_DTYPE, D_T, D_WIDTH, D_COUNTS = 0, 1, 2, 3, 4
# Combine header words (one row per expert rank, in the home's segment).
C_FLAG, C_DTYPE, C_COUNT, C_WORDS = 0, 1, 2, 4
# `ll.done[kind, half, word]`: CONSUMED, the last call of that kind whose receive half
# finished (or that this rank rejected) on that half; SKIPPED, a rejected call whose
# half was still held by an older call, released when that older call is consumed.
DISPATCH, COMBINE = 0, 1
CONSUMED, SKIPPED = 0, 1
KINDS = {"dispatch": DISPATCH, "combine": COMBINE}


def add_ll_regions(layout: SegmentLayout, s: Sizing) -> None:
    """Append the low-latency regions (double-buffered) to a segment layout."""
    R, T, K, L = s.num_ranks, s.capacity, s.max_topk, s.placement.num_local_experts
    for p in (0, 1):
        layout.add(f"ll.d{p}.hdr", (R, D_COUNTS + L), torch.int64)
        layout.add(f"ll.d{p}.x", (L, R, T, s.row_bytes), torch.uint8)
        layout.add(f"ll.d{p}.src", (L, R, T), torch.int64)  # token * max_topk + k
        layout.add(f"ll.c{p}.hdr", (R, C_WORDS), torch.int64)
        layout.add(f"ll.c{p}.x", (T * K, s.row_bytes), torch.uint8)
    layout.add("ll.done", (2, 2, 2), torch.int64)
    layout.add("ll.rejected", (2,), torch.int64)  # per kind: the last call this rank rejected


class LLShm:
    """Low-latency halves among the ranks of one host, on the Buffer's heap."""

    name = "ubep-ll"

    def __init__(self, peers: ShmPeers):
        self.peers = peers
        self.heap = peers.heap
        self.sizing: Sizing = peers.sizing
        self.me = peers.rank
        self.R = peers.num_ranks

    # -- buffer reuse -----------------------------------------------------------------------------

    def _reserve(self, call: CallId, kind: int, what: str) -> None:
        """Wait until every peer consumed call e - 2 of this kind (it used the same half)."""
        p, before = call.parity, call.epoch - 2
        done = [self.heap.words(r, "ll.done") for r in range(self.R)]
        if done[self.me][kind, p, CONSUMED] < before:
            raise RuntimeError(
                f"low-latency {what} #{call.epoch}: call #{before} still awaits its receive half "
                "(hook or event.wait()); at most two low-latency calls of a kind may be in flight"
            )
        waiter = self.peers.waiter(f"low-latency {what} (buffer reuse)", call)
        pending = [r for r in range(self.R) if r != self.me]
        while pending:
            pending = [r for r in pending if done[r][kind, p, CONSUMED] < before]
            if pending:
                waiter.pause(pending)

    def _wait(self, phase: str, call: CallId, kind: int, ready, peers: list[int]) -> None:
        """Wait until ready(r) for every r in peers; raise at once if one of them rejected this call.

        A peer whose stamp for call e is missing while its `ll.rejected` is >= e
        rejected e itself: had it sent e, nothing could have replaced e's stamp,
        since e + 2 may be written only after this rank consumed e.
        """
        rejected = [self.heap.words(r, "ll.rejected") for r in range(self.R)]
        waiter = self.peers.waiter(phase, call)
        pending = list(peers)
        while pending:
            pending = [r for r in pending if not ready(r)]
            gone = [r for r in pending if rejected[r][kind] >= call.epoch]
            if gone:
                notice = AbortNotice("it rejected its input for this call; see that rank's error")
                raise PeerAbortedError(phase, gone[0], notice)
            if pending:
                waiter.pause(pending)

    def _consumed(self, call: CallId, kind: int) -> None:
        """This rank read its last byte of the call's half: peers may reuse it."""
        done = self.heap.words(self.me, "ll.done")[kind, call.parity]
        done[CONSUMED] = max(call.epoch, int(done[SKIPPED]))
        self.peers.ring_all()  # a peer may wait to reuse this half

    def abort(self, call: CallId, kind: str) -> None:
        """Tell peers this call is off; release its half now, or when the older call holding it is done.

        The rejection is published per kind (`ll.rejected`), not only in the control
        block's single abort word, which this rank's next rejection would overwrite
        before a peer's pending receive half got to read it.
        """
        rejected = self.heap.words(self.me, "ll.rejected")
        rejected[KINDS[kind]] = max(int(rejected[KINDS[kind]]), call.epoch)
        done = self.heap.words(self.me, "ll.done")[KINDS[kind], call.parity]
        if done[CONSUMED] >= call.epoch - 2:
            done[CONSUMED] = call.epoch
        else:
            done[SKIPPED] = call.epoch
        self.peers.abort(call)  # last: it rings every peer, who then sees all of the above

    # -- dispatch ---------------------------------------------------------------------------------

    def dispatch_send(self, call: CallId, plan: LLDispatchPlan, out: LLDispatchOut) -> Callable[[], None]:
        try:
            self._reserve(call, DISPATCH, "dispatch")
            for i in range(1, self.R + 1):  # others first, own slots last
                self._put_tokens(call, plan, (self.me + i) % self.R)
        except BaseException:
            self.abort(call, "dispatch")
            raise
        return lambda: self._receive_tokens(call, out)

    def _put_tokens(self, call: CallId, plan: LLDispatchPlan, dst: int) -> None:
        p, pairs, B = call.parity, plan.to(dst), plan.rows_NB.shape[1]
        counts_L = plan.counts_RL[dst]
        local_n, index_n = slot_positions(counts_L)
        token_n = plan.pair_token_P[pairs]
        slots = self.heap.tensor(dst, f"ll.d{p}.x")[:, self.me, :, :B]  # [L, T, B]
        (slots_w,) = as_words(slots)
        slots_w[local_n, index_n] = gather_rows(plan.rows_NB, token_n).view(slots_w.dtype)
        src = self.heap.tensor(dst, f"ll.d{p}.src")[:, self.me]
        src[local_n, index_n] = token_n * self.sizing.max_topk + plan.pair_k_P[pairs]
        hdr = self.heap.words(dst, f"ll.d{p}.hdr")[self.me]
        hdr[D_COUNTS:] = counts_L.numpy()
        hdr[D_DTYPE], hdr[D_T], hdr[D_WIDTH] = plan.code, plan.max_tokens, B
        hdr[D_FLAG] = call.epoch  # the rows above are visible from here on
        self.peers.ring(dst)

    def _receive_tokens(self, call: CallId, out: LLDispatchOut) -> None:
        p, K = call.parity, self.sizing.max_topk
        hdrs = self.heap.words(self.me, f"ll.d{p}.hdr")
        landed = _stamped(hdrs, D_FLAG, call.epoch)
        slots = self.heap.tensor(self.me, f"ll.d{p}.x")
        srcs = self.heap.tensor(self.me, f"ll.d{p}.src")
        begin_L = torch.zeros(hdrs.shape[1] - D_COUNTS, dtype=torch.int64)
        try:
            for src in range(self.R):
                self._wait("low-latency dispatch (tokens)", call, DISPATCH, landed, [src])
                counts_L = self._check_tokens(src, hdrs[src], out)
                local_n, index_n = slot_positions(counts_L)
                (slots_w,) = as_words(slots[:, src, :, : out.row_width])
                rows_nB = slots_w[local_n, index_n].view(torch.uint8)
                info_n = srcs[:, src][local_n, index_n]
                place_source(out, src, begin_L, counts_L, rows_nB, info_n // K, info_n % K)
                begin_L = begin_L + counts_L
            out.handle.recv_count_L.copy_(begin_L)
        finally:
            self._consumed(call, DISPATCH)

    def _check_tokens(self, src: int, hdr, out: LLDispatchOut) -> torch.Tensor:
        """A landed source's per-expert counts, after checking its header against this call."""
        T = out.handle.num_max_dispatch_tokens_per_rank
        if int(hdr[D_T]) != T:
            raise PeerDataError(f"low-latency dispatch: rank {src} used T={int(hdr[D_T])}, this rank T={T}")
        if int(hdr[D_DTYPE]) != out.code or int(hdr[D_WIDTH]) != out.row_width:
            raise PeerDataError(
                f"low-latency dispatch: rank {src} sent another payload format "
                "(all ranks must pass the same dtype and use_fp8)"
            )
        counts_L = torch.from_numpy(hdr[D_COUNTS:].copy())
        if counts_L.numel() and (counts_L.min() < 0 or counts_L.max() > T):
            raise PeerDataError(f"low-latency dispatch: rank {src} announced counts outside [0, {T}]")
        return counts_L

    # -- combine ----------------------------------------------------------------------------------

    def combine_send(self, call: CallId, plan: LLCombinePlan, out_NH: torch.Tensor) -> Callable[[], None]:
        try:
            self._reserve(call, COMBINE, "combine")
            for i in range(1, self.R + 1):
                self._put_rows(call, plan, (self.me + i) % self.R)
        except BaseException:
            self.abort(call, "combine")
            raise
        return lambda: self._reduce(call, plan, out_NH)

    def _put_rows(self, call: CallId, plan: LLCombinePlan, home: int) -> None:
        p, rows, B = call.parity, plan.to(home), plan.x_LMB.shape[2]
        target_Q = plan.token_Q[rows] * self.sizing.max_topk + plan.k_Q[rows]
        (slots_w,) = as_words(self.heap.tensor(home, f"ll.c{p}.x")[:, :B])  # [T * max_topk, B]
        slots_w[target_Q] = returned_rows(plan, rows).view(slots_w.dtype)
        hdr = self.heap.words(home, f"ll.c{p}.hdr")[self.me]
        hdr[C_DTYPE], hdr[C_COUNT] = plan.code, rows.stop - rows.start
        hdr[C_FLAG] = call.epoch
        self.peers.ring(home)

    def _reduce(self, call: CallId, plan: LLCombinePlan, out_NH: torch.Tensor) -> None:
        p, (N, K), B = call.parity, plan.valid_NK.shape, plan.x_LMB.shape[2]
        hdrs = self.heap.words(self.me, f"ll.c{p}.hdr")
        expected = {r: plan.expected_from(r) for r in range(self.R)}
        try:
            senders = [r for r, n in expected.items() if n > 0]
            landed = _stamped(hdrs, C_FLAG, call.epoch)
            self._wait("low-latency combine", call, COMBINE, landed, senders)
            for r in senders:
                self._check_rows(r, hdrs[r], expected[r], plan.code)
            slot_NK = (torch.arange(N).unsqueeze(1) * self.sizing.max_topk + torch.arange(K)).flatten()
            y_NKB = gather_rows(self.heap.tensor(self.me, f"ll.c{p}.x")[:, :B], slot_NK).view(N, K, B)
            reduce_rows(plan, y_NKB, out_NH)
        finally:
            self._consumed(call, COMBINE)

    @staticmethod
    def _check_rows(src: int, hdr, expected: int, code: int) -> None:
        if int(hdr[C_COUNT]) != expected:
            raise PeerDataError(
                f"low-latency combine: rank {src} returned {int(hdr[C_COUNT])} rows, expected {expected}"
            )
        if int(hdr[C_DTYPE]) != code:
            raise PeerDataError(f"low-latency combine: rank {src} returned another dtype than this rank's x")


def _stamped(hdrs, column: int, epoch: int) -> Callable[[int], bool]:
    """`ready` for `_wait`: whether header row r carries this call's stamp (read live)."""
    return lambda r: hdrs[r, column] == epoch

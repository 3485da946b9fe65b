"""Low-latency dispatch/combine over a one-sided transport: puts into per-peer slots, data as flag.

Dispatch (call epoch e, half p = e % 2 of every double-buffered region):
  send half: stage this rank's N rows once, in rows 0..N-1 of its own slots for
    source `me` (`ll.slots[me]` in its own memory); then for each destination d,
    write the (token, top-k slot) of every (token, expert on d) pair into d's
    slot infos for (local expert j, this rank), and publish this rank's header in
    d (the per-expert counts, dtype, T), stamped e, last.
    The counts travel with the data: there is no count round and no barrier.
  receive half: for each source s in ascending order, wait for its stamp, then
    copy the rows its infos name, from s's staged rows, into
    recv_x[j, begin : begin + count], where begin is the rows already placed for
    j by sources < s. Finally publish "dispatch e consumed".
  A token goes to up to K experts on several ranks: staged once, it is copied once
  per (token, expert) pair by its receivers, where putting it into each receiver's
  slots copied it twice per pair (docs/low_latency.md). The Triton halves still
  put rows into the receiver's slots (a GPU writes its NVLink peers' memory): the
  `ll_rows` word of the handshake keeps the two forms out of one group.
Combine mirrors it: the expert rank puts the rows y(t, k) it returns to a home
  into its own run of the home's back slots, `ll.back_slots[me]`, ordered by
  (local expert, token) as its dispatch received them, then publishes its header
  in the home; the home waits for the stamps of the ranks it expects rows from,
  finds each (t, k) in its expert rank's run, and reduces over k.

Every byte a rank puts into a peer lies in a block of its own there (a row of an
inbox header, its run of slots), and a peer reads a writer's blocks only while
the writer is live. So once the peers masked a rank, nothing it writes can reach
their results, however late a put that was under way lands (docs/reliability.md,
"A masked rank that wakes"); the writer also checks its membership before its first
put and after each block, and stops with MaskedOutError.

Reuse argument (two outstanding calls, double buffering). The slots for call e
are reused by call e + 2. A sender writes call e + 2 (into d, or its own staged
rows that d reads) only after reading every peer d's "consumed" word for that
half (`done[kind, p]`) at >= e, which d writes at the end of its receive half of
e, after its last read of those slots. So no
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

from ubep.calls import CallId
from ubep.engine import Engine
from ubep.errors import PeerDataError
from ubep.faults import NO_FAULTS, FaultPoints
from ubep.protocols import halves
from ubep.protocols.base import LowLatencyExchange, Sizing
from ubep.protocols.ll import status as ll_status
from ubep.protocols.ll.blocks import COMBINE, CONSUMED, DISPATCH, KINDS, SKIPPED, LLBlocks
from ubep.protocols.ll.plans import (
    AFTER_DATA,
    IN_WORD,
    LLCombinePlan,
    LLDispatchOut,
    LLDispatchPlan,
    per_writer,
    place_source,
    reduce_returned,
    returned_rows,
    slot_positions,
)
from ubep.registry import ENGINES
from ubep.results import LowLatencyHandle
from ubep.transport.base import Header, Region, Transport
from ubep.waiting import rejected_input


class LLExchange(LowLatencyExchange):
    """Low-latency halves over a one-sided transport, with any engine."""

    name = "ubep-ll"

    def __init__(
        self,
        transport: Transport,
        engine: Engine,
        sizing: Sizing,
        faults: FaultPoints = NO_FAULTS,
        flag: str = AFTER_DATA,
        capturable: bool = False,
    ):
        self.t, self.engine, self.sizing, self.faults = transport, engine, sizing, faults
        self.me, self.R = transport.rank, transport.num_ranks
        self.blocks = LLBlocks.of(sizing, in_word=flag == IN_WORD)
        self._per_writer = per_writer(sizing)
        on_heap = hasattr(transport, "address_table")
        # on_device: the halves are Triton kernels that take wire rows, check this rank's input values
        # themselves and read nothing back on the host (with capturable=True): `Buffer` skips its value checks
        self.on_device = ENGINES[engine.name].device_kernels and on_heap
        if (flag != AFTER_DATA or capturable) and not self.on_device:
            raise ValueError(
                f"flag={flag!r}, capturable={capturable}: these need low-latency mode's Triton halves "
                "(engine 'triton' on a heap: transport 'shm', 'virtual' or 'cuda')"
            )

        def on_numba():
            from ubep.protocols.ll.numba_driver import LLNumba  # imports numba: only on its engine

            return LLNumba(transport, self.blocks, sizing, self._consumed, faults)

        def on_triton():
            from ubep.protocols.ll.triton_driver import LLTriton  # imports triton: only on its engine

            return LLTriton(transport, self.blocks, sizing, self._consumed, engine, capturable, flag=flag)

        # each call half one compiled function, where the engine and memory allow; they route and
        # check this rank's inputs themselves
        self._compiled = halves.compiled_form(engine, on_numba, on_triton) if on_heap else None
        self.routes_in_halves = self._compiled is not None
        self.finishes_combine = not self.on_device  # the Triton halves keep their state on the device

    @property
    def halves(self) -> str:
        """How each call half runs here, in words (for `Buffer.explain`)."""
        if self._compiled is None:
            return "step by step in Python"
        if self.on_device:
            d = self._compiled
            return (
                "one Triton kernel launch each"
                + (" (the interpreter, on the CPU)" if d.device.type == "cpu" else "")
                + (
                    ", rows in 8-byte words of payload and epoch, each its own flag (in-word)"
                    if d.in_word
                    else ", rows then a released stamp (after-data)"
                )
                + (", capturable: no host read, errors at check()" if d.capturable else "")
            )
        return "one compiled function each"

    # -- buffer reuse -----------------------------------------------------------------------------

    def _reserve(self, call: CallId, kind: int, what: str) -> None:
        """Wait until every peer consumed call e - 2 of this kind (it used the same half)."""
        p, before = call.parity, call.epoch - 2
        done = [self.t.words(self.blocks.done, r) for r in range(self.R)]
        if done[self.me][kind, p, CONSUMED] < before:
            raise RuntimeError(
                f"low-latency {what} #{call.epoch}: call #{before} still awaits its receive half "
                "(hook or event.wait()); at most two low-latency calls of a kind may be in flight"
            )
        others = [r for r in self.t.live if r != self.me]
        self.t.wait(
            f"low-latency {what} (buffer reuse)", call, others, lambda r: done[r][kind, p, CONSUMED] >= before
        )

    def _landed(self, phase: str, call: CallId, kind: int, header: Header, peers: list[int]) -> None:
        """Wait until every peer's header landed; raise at once if one of them rejected this call.

        A peer whose stamp for call e is missing while its `rejected` word is >= e
        rejected e itself: had it sent e, nothing could have replaced e's stamp,
        since e + 2 may be written only after this rank consumed e.
        """
        rejected = [self.t.words(self.blocks.rejected, r) for r in range(self.R)]

        def ready(r: int) -> bool:
            if self.t.stamped(header, call, r):
                return True
            if rejected[r][kind] >= call.epoch:
                raise rejected_input(phase, r)
            return False

        self.t.wait(phase, call, peers, ready)

    def _own_words(self, region: Region):
        """This rank's int64 words of a reuse region: numpy over host memory, or, where the region
        lives on a GPU (the CUDA heap refuses `words` there), a tensor over it (writes are kernels)."""
        try:
            return self.t.words(region, self.me)
        except TypeError:
            return self.t.view(region, self.me)

    def _consumed(self, call: CallId, kind: int) -> None:
        """This rank read its last byte of the call's half: peers may reuse it."""
        done = self._own_words(self.blocks.done)[kind, call.parity]
        done[CONSUMED] = max(call.epoch, int(done[SKIPPED]))
        self.t.ring()  # a peer may wait to reuse this half

    def abort(self, call: CallId, kind: str) -> None:
        """Tell peers this call is off; release its half now, or when the older call holding it is done.

        The rejection is published per kind (`rejected`), not only in the control
        block's single abort word, which this rank's next rejection would overwrite
        before a peer's pending receive half got to read it.
        """
        if self.on_device:
            self._compiled.skip(call, KINDS[kind])
        rejected = self._own_words(self.blocks.rejected)
        rejected[KINDS[kind]] = max(int(rejected[KINDS[kind]]), call.epoch)
        done = self._own_words(self.blocks.done)[KINDS[kind], call.parity]
        if done[CONSUMED] >= call.epoch - 2:
            done[CONSUMED] = call.epoch
        else:
            done[SKIPPED] = call.epoch
        self.t.abort(call)  # last: it rings every peer, who then sees all of the above

    def _others_first(self) -> list[int]:
        """The live ranks in the order of sends: the next ranks first, this rank last."""
        return sorted(self.t.live, key=lambda r: (r - self.me - 1) % self.R)

    def resume(self, seq: int) -> None:
        """After ranks were masked and the rest resume after call `seq`: every call up to it is over
        (a pending receive half from before is abandoned), so both halves are free again."""
        done = self._own_words(self.blocks.done)
        done[:, :, CONSUMED] = seq
        if self.on_device:
            self._compiled.restart(seq)
        self.t.ring()  # a peer may wait to reuse a half

    # -- dispatch ---------------------------------------------------------------------------------

    def dispatch_send(self, call: CallId, plan: LLDispatchPlan, out: LLDispatchOut) -> Callable[[], None]:
        self.t.begin(call)
        try:
            if self._compiled is not None:
                return self._compiled.dispatch_send(call, plan, out)
            self._reserve(call, DISPATCH, "dispatch")
            self._stage_tokens(call, plan)
            for dst in self._others_first():
                self._put_infos(call, plan, dst)
                self.t.check_member("low-latency dispatch (send)")  # after each block it put
        except BaseException:
            self.abort(call, "dispatch")
            raise
        return lambda: self._receive_tokens(call, out)

    def _staged(self, call: CallId, owner: int) -> torch.Tensor:
        """uint8 [L * T, row bytes]: rank `owner`'s slots for its own rows, where it stages them."""
        slots_LTB = self.t.view(self.blocks.slots, owner, call)[owner]  # contiguous
        L, T, width = slots_LTB.shape
        return slots_LTB.view(L * T, width)

    def _stage_tokens(self, call: CallId, plan: LLDispatchPlan) -> None:
        """This rank's N rows, once, into rows 0..N-1 of its own slots[me] (before any stamp)."""
        N, B = plan.rows_NB.shape
        self.engine.copy_rows(plan.rows_NB, None, self._staged(call, self.me)[:N, :B], None)

    def _put_infos(self, call: CallId, plan: LLDispatchPlan, dst: int) -> None:
        b, t, pairs, B = self.blocks, self.t, plan.to(dst), plan.rows_NB.shape[1]
        counts_L = plan.counts_RL[dst]
        local_n, index_n = slot_positions(counts_L)
        info_LT = t.view(b.slot_info, dst, call)[self.me]
        info_LT[local_n, index_n] = plan.pair_token_P[pairs] * self.sizing.max_topk + plan.pair_k_P[pairs]
        values = {"dtype": plan.code, "T": plan.max_tokens, "width": B, "counts": counts_L.tolist()}
        t.publish(b.sent, call, values, to=dst)  # the staged rows and the infos are visible from here on

    def _receive_tokens(self, call: CallId, out: LLDispatchOut) -> None:
        b, t, K = self.blocks, self.t, self.sizing.max_topk
        infos = t.view(b.slot_info, self.me, call)
        begin_L = torch.zeros(
            self.sizing.placement.num_local_experts, dtype=torch.int64, device=out.handle.recv_count_L.device
        )
        try:
            for src in range(self.R):
                if src not in self.t.live:  # masked: sends nothing
                    out.handle.layout_range_LR2[:, src, 0] = begin_L
                    out.handle.layout_range_LR2[:, src, 1] = 0
                    continue
                self._landed("low-latency dispatch (tokens)", call, DISPATCH, b.sent, [src])
                counts_L = self._check_tokens(call, src, out)
                local_n, index_n = slot_positions(counts_L)
                info_n = infos[src][local_n, index_n]
                token_n, k_n = info_n // K, info_n % K
                if info_n.numel() and (
                    info_n.min() < 0 or token_n.max() >= out.handle.num_max_dispatch_tokens_per_rank
                ):
                    raise t.bad_data(
                        call, src, f"low-latency dispatch: rank {src} sent token indices out of range"
                    )
                rows_nB = self._staged(call, src)[token_n, : out.row_width]  # read from src's memory
                place_source(self.engine, out, src, begin_L, counts_L, rows_nB, token_n, k_n)
                begin_L = begin_L + counts_L
            self.t.check_member("low-latency dispatch")  # what was read above was whole
            out.handle.recv_count_L.copy_(begin_L)
        finally:
            self._consumed(call, DISPATCH)

    def _check_tokens(self, call: CallId, src: int, out: LLDispatchOut) -> torch.Tensor:
        """A landed source's per-expert counts, after checking its header against this call."""
        got = self.t.read(self.blocks.sent, call, src)
        T = out.handle.num_max_dispatch_tokens_per_rank
        if got["T"] != T:
            raise PeerDataError(f"low-latency dispatch: rank {src} used T={got['T']}, this rank T={T}")
        if got["dtype"] != out.code or got["width"] != out.row_width:
            raise PeerDataError(
                f"low-latency dispatch: rank {src} sent another payload format "
                "(all ranks must pass the same dtype and use_fp8)"
            )
        counts_L = torch.from_numpy(got["counts"].copy())
        if counts_L.numel() and counts_L.max() > T:
            raise PeerDataError(f"low-latency dispatch: rank {src} announced counts outside [0, {T}]")
        return counts_L

    # -- combine ----------------------------------------------------------------------------------

    def combine_send(self, call: CallId, plan: LLCombinePlan, out_NH: torch.Tensor) -> Callable[[], None]:
        self.t.begin(call)
        try:
            if self._compiled is not None:  # it checks the rows per home itself
                return self._compiled.combine_send(call, plan, out_NH)
            if int(plan.send_counts_R.max()) > self._per_writer:
                raise too_many_returned(plan, self._per_writer)
            self._reserve(call, COMBINE, "combine")
            for i, home in enumerate(self._others_first()):
                if i == 1:
                    self.faults.at("ll_combine.put", call)  # after a block and its check (fault tests)
                self._put_rows(call, plan, home)
                self.t.check_member("low-latency combine (send)")  # after each block it put
        except BaseException:
            self.abort(call, "combine")
            raise
        return lambda: self._reduce(call, plan, out_NH)

    def combine_rows(
        self,
        call: CallId,
        x_LMH: torch.Tensor,
        weights_NK: torch.Tensor,
        handle: LowLatencyHandle,
        out_NH: torch.Tensor,
        topk_NK: torch.Tensor,
    ) -> Callable[[], None]:
        """`routes_in_halves` only: combine's send half from the expert outputs and the handle alone (no
        plan, which reads counts on the host); the half checks what `combine_send`'s callers check on
        the host (the handle received, topk_NK the dispatch's, no home over its run)."""
        self.t.begin(call)
        try:
            return self._compiled.combine_rows(call, x_LMH, weights_NK, handle, out_NH, topk_NK)
        except BaseException:
            self.abort(call, "combine")
            raise

    def check(self) -> None:
        """Capturable device halves: raise the first error the device recorded since the last check."""
        if self.on_device:
            self._compiled.check()

    def finish_combine(self, call: CallId, got) -> None:
        if self._compiled is not None:
            self._compiled.finish_combine(call, got.x, got.handle, got.topk_weights_NK, got.out_NH)
        else:
            self._reduce(call, got.plan, got.out_NH)

    def _put_rows(self, call: CallId, plan: LLCombinePlan, home: int) -> None:
        b, rows, B = self.blocks, plan.to(home), plan.x_LMB.shape[2]
        n = rows.stop - rows.start
        slots_XB = self.t.view(b.back_slots, home, call)[self.me, :n, :B]  # this rank's run there
        self.engine.copy_rows(returned_rows(plan, rows), None, slots_XB, None)
        self.t.publish(b.returned, call, {"dtype": plan.code, "count": n}, to=home)

    def _reduce(self, call: CallId, plan: LLCombinePlan, out_NH: torch.Tensor) -> None:
        b, B = self.blocks, plan.x_LMB.shape[2]
        expected = {r: plan.expected_from(r) for r in range(self.R)}
        try:
            senders = [r for r, n in expected.items() if n > 0]
            self._landed("low-latency combine", call, COMBINE, b.returned, senders)
            for r in senders:
                got = self.t.read(b.returned, call, r)
                if got["count"] != expected[r] or got["dtype"] != plan.code:
                    raise PeerDataError(
                        f"low-latency combine: rank {r} returned {got['count']} rows (dtype code "
                        f"{got['dtype']}), expected {expected[r]} (code {plan.code})"
                    )
            slots_RXB = self.t.view(b.back_slots, self.me, call)  # each sender's run, in home order
            rows_PB = torch.cat([slots_RXB[r, : expected[r], :B] for r in senders] or [slots_RXB[0, :0, :B]])
            self.t.check_member("low-latency combine")  # the rows were whole
            reduce_returned(self.engine, plan, rows_PB, out_NH)
        finally:
            self._consumed(call, COMBINE)


def too_many_returned(plan: LLCombinePlan, most: int) -> PeerDataError:
    """An expert rank returns each home at most `most` rows (its run of the home's back slots);
    more means the home's dispatch sent it a token twice for one expert, or too many tokens."""
    home = int(plan.send_counts_R.argmax())
    return ll_status.too_many_returned(home, int(plan.send_counts_R[home]), most)

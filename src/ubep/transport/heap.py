"""`Heap`: the transport interface over memory every rank can address (one implementation).

Where the memory lives and how a sleeping peer is woken are the only things
that differ between a host's shared segments and a virtual world of threads;
both are behind `Memory`. Everything a protocol relies on is here, once:

- the layout: each declared `Region` and `Header` at the same offset in every
  rank's memory (double-buffered ones twice), after a control block;
- publication (payload, then stamp, then a ring) and `landed`, the one wait
  loop: yield, then block on the wake-up channel, under a deadline, noticing
  dead and aborting peers;
- the control block: the barrier word and a ring of abort notices,
  one per call (slot seq % ABORT_RING), so a notice outlives the rank's next
  calls and a slow peer still finds it there; and a ring of the calls the
  rank began (kind and per-kind number, slot seq % CALL_RING), so a wait that
  goes on finds at once a peer whose call of the same seq is another one;
- membership: `mask` drops dead ranks from every later wait and barrier, after
  the survivors agree (in the `members` block) on whom and on the call to
  resume from; `join` / `admissions` / `admit` take a process restarted in a
  masked rank's place back in, at a call all agree on (the `joins` block).

Legend: see `ubep.layout`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ubep.calls import KINDS, METHODS, CallId
from ubep.errors import CommTimeoutError, MaskedOutError, PeerDataError, RejoinError, UbepError
from ubep.timers import BlockTimes
from ubep.transport.base import Agreement, Field, Header, Record, Region
from ubep.waiting import YIELD_POLLS, AbortNotice, PeerAbortedError, ProcessId, Waiter

ALIGN = 64  # bytes; every block starts on a cache line
# Control block words: the barrier word, the word a compiled half raises while it sleeps on its
# doorbell (publishers ring only such ranks), (from the next cache line) a ring of abort notices,
# then a ring of the calls begun, then who the rank's process is (pid, PID namespace, start time:
# peers learn a rejoined rank's here) and the job's doorbell secret (what a rejoining process reads).
CTL_BARRIER, CTL_ASLEEP, CTL_ABORTS, ABORT_RING = 0, 1, 8, 16
CTL_CALLS, CALL_RING = CTL_ABORTS + ABORT_RING, 16
CTL_ID, ID_WORDS = CTL_CALLS + CALL_RING, 3
CTL_KEY, KEY_WORDS = CTL_ID + ID_WORDS, 4
CTL_WORDS = CTL_KEY + KEY_WORDS
# The `joins` block's rows: in every staying rank's memory, a process restarting as rank r writes its
# pid at ASKED[r]; the leader (the lowest live rank) writes at ANNOUNCED[r] the call before which
# every staying rank takes it in. Two calls ahead: a rank learns the leader's choice from its data,
# which every call waits for, so every rank has read it before it begins that call.
ASKED, ANNOUNCED, ADMIT_AHEAD = 0, 1, 2
# Why a rank aborted a call; a notice packs (seq, cause, culprit + 1) into one word.
CAUSE_OWN, CAUSE_DEAD, CAUSE_SILENT, CAUSE_BAD_DATA, CAUSE_ABORTED, CAUSE_OUT_OF_STEP = 0, 1, 2, 3, 4, 5
BLAME = {
    CAUSE_DEAD: "died",
    CAUSE_SILENT: "sent nothing before the deadline",
    CAUSE_BAD_DATA: "published data that failed its checks",
    CAUSE_ABORTED: "aborted the call",  # passed on: the culprit gave up first, for its own reason
    CAUSE_OUT_OF_STEP: "made another call (the ranks' call sequences differ)",
}
BARRIERS_PER_CALL = 16  # barrier targets are call.seq * this + step: ranks agree even after an abort


def pack_notice(seq: int, cause: int, culprit: int) -> int:
    return (seq << 24) | (cause << 16) | (culprit + 1)


def unpack_notice(word: int) -> tuple[int, int, int]:
    """(seq, cause, culprit) of a packed abort notice; culprit -1: none."""
    return word >> 24, (word >> 16) & 0xFF, (word & 0xFFFF) - 1


def unpack_call(word: int) -> tuple[int, int, int]:
    """(seq, per-kind number, kind code; 0: no known kind) of a call-ring word (`Heap.begin`)."""
    return word >> 32, (word >> 8) & 0xFFFFFF, word & 0xFF


class Layout:
    """Byte offsets of every block, the same in every rank's memory.

    `nbytes`: what a rank's memory maps; `touchable`: the most of it the calls can touch, every
    block whole but for a `Region.touch` bound, per half (the gaps between blocks are never touched).
    """

    def __init__(self, num_ranks: int, blocks: Iterable[Region | Header]):
        self.nbytes = self.touchable = 0
        self.offsets: dict[tuple[str, int], tuple[int, tuple[int, ...], torch.dtype]] = {}
        self._place("ctl", 0, (CTL_WORDS,), torch.int64)
        # Two generations of a rank's membership record: [generation, call seq, masked flag per rank].
        self._place("members", 0, (2, 2 + num_ranks), torch.int64)
        self._place("joins", 0, (2, num_ranks), torch.int64)  # [ASKED, ANNOUNCED] per rank
        for block in blocks:
            shape, dtype = _shape_of(block, num_ranks)
            if any(name == block.name for name, _ in self.offsets):
                raise ValueError(f"two blocks are named {block.name!r}")
            touch = block.touch if isinstance(block, Region) else None
            for half in (0, 1) if block.double else (0,):
                self._place(block.name, half, shape, dtype, touch)

    def _place(
        self, name: str, half: int, shape: tuple[int, ...], dtype: torch.dtype, touch: int | None = None
    ) -> None:
        offset = -(-self.nbytes // ALIGN) * ALIGN
        nbytes = math.prod(shape) * dtype.itemsize
        self.offsets[(name, half)] = (offset, shape, dtype)
        self.nbytes = offset + nbytes
        self.touchable += nbytes if touch is None else min(touch, nbytes)


def _shape_of(block: Region | Header, num_ranks: int) -> tuple[tuple[int, ...], torch.dtype]:
    if isinstance(block, Header):
        return ((num_ranks, block.words) if block.inbox else (block.words,)), torch.int64
    return tuple(int(s) for s in block.shape), block.dtype


class Memory(Protocol):
    """Every rank's memory as seen from one rank, and the way to wake a peer."""

    def arena(self, owner: int) -> torch.Tensor:
        """uint8 [nbytes]: all of rank `owner`'s memory."""

    def ring(self, peer: int) -> None:
        """Wake `peer` if it blocks in `sleep`; never blocks, never fails."""

    def sleep(self, timeout_s: float) -> None:
        """Block until rung or `timeout_s` passes."""

    def close(self) -> None: ...


class Heap:
    """The transport interface (`ubep.transport.base.Transport`) over a `Memory`."""

    def __init__(self, layout: Layout, memory: Memory, rank: int, num_ranks: int, timeout_s: float):
        self.rank, self.num_ranks, self.timeout_s = rank, num_ranks, timeout_s
        self._layout, self._memory = layout, memory
        self._views: dict[tuple[str, int, int], torch.Tensor] = {}
        self._numpy: dict[tuple[str, int, int], np.ndarray] = {}
        self._bounds: dict[Header, _Bounds] = {}
        self._ctl = [self._words_at("ctl", 0, r) for r in range(num_ranks)]
        self._members = [self._words_at("members", 0, r) for r in range(num_ranks)]
        self._joins = [self._words_at("joins", 0, r) for r in range(num_ranks)]
        self._ctl_at = np.array([words.ctypes.data for words in self._ctl], dtype=np.int64)
        self.live: tuple[int, ...] = tuple(range(num_ranks))  # the ranks still taking part
        self.live_R = np.arange(num_ranks, dtype=np.int64)  # the same, for compiled halves
        self.generation = 0  # how many times membership changed: a later record masking this rank means out
        self._peers: tuple[ProcessId | None, ...] = (None,) * num_ranks
        self._current_seq = 0
        self._current: tuple[CallId, str] | None = None  # the call and phase of the latest wait
        self._resumed_after = -1  # the seq the ranks resumed after at the latest mask (`mask`)
        self._handled: dict[int, int] = {}  # per rank, the leader's announcement this rank acted on
        self._barrier_seq = self._barrier_step = 0

    # -- memory -----------------------------------------------------------------------------------

    def _tensor_at(self, name: str, half: int, owner: int) -> torch.Tensor:
        key = (name, half, owner)
        view = self._views.get(key)
        if view is None:
            offset, shape, dtype = self._layout.offsets[(name, half)]
            nbytes = math.prod(shape) * dtype.itemsize
            raw = self._memory.arena(owner)[offset : offset + nbytes]
            view = self._views[key] = raw.view(dtype).view(shape)
        return view

    def _words_at(self, name: str, half: int, owner: int) -> np.ndarray:
        key = (name, half, owner)
        words = self._numpy.get(key)
        if words is None:
            words = self._numpy[key] = self._tensor_at(name, half, owner).numpy()
        return words

    def view(self, region: Region, owner: int, call: CallId | None = None) -> torch.Tensor:
        half = (call.epoch & 1 if call is not None else _half(True, None)) if region.double else 0
        view = self._views.get((region.name, half, owner))  # the hot path: one dict look-up
        return view if view is not None else self._tensor_at(region.name, half, owner)

    def address_table(self, blocks: Sequence[Region | Header]) -> tuple[np.ndarray, np.ndarray]:
        """(table int64 [R, len(blocks), 2], asleep int64 [R]): the address of every block in every
        rank's memory for both halves (a single-buffered block's twice), and of each rank's ASLEEP
        word; what compiled halves work over. Addresses never change after construction."""
        table = np.empty((self.num_ranks, len(blocks), 2), dtype=np.int64)
        for r in range(self.num_ranks):
            base = self._memory.arena(r).data_ptr()
            for b, block in enumerate(blocks):
                for half in (0, 1):
                    table[r, b, half] = (
                        base + self._layout.offsets[(block.name, half if block.double else 0)][0]
                    )
        ctl = self._layout.offsets[("ctl", 0)][0]
        asleep = np.array(
            [self._memory.arena(r).data_ptr() + ctl + 8 * CTL_ASLEEP for r in range(self.num_ranks)]
        )
        return table, asleep.astype(np.int64)

    def members_at(self) -> np.ndarray:
        """int64 [R]: the address of every rank's `members` block (two records of [generation, call
        seq, masked flag per rank]), for a compiled writer's membership check (`check_member`)."""
        at = self._layout.offsets[("members", 0)][0]
        return np.array([self._memory.arena(r).data_ptr() + at for r in range(self.num_ranks)], np.int64)

    def ring_marked(self, wake_R: np.ndarray, times: BlockTimes | None = None) -> None:
        """Ring every peer marked in `wake_R` (uint8 [R], as a compiled half left it); clear the marks.
        `times` (the call's timers, when on) counts the rings."""
        marked = np.flatnonzero(wake_R).tolist()
        for p in marked:
            self._memory.ring(p)
        wake_R[:] = 0
        if times is not None:
            times.rings += len(marked)

    def words(self, region: Region, owner: int) -> np.ndarray:
        if region.dtype != torch.int64:
            raise TypeError(f"region {region.name} holds {region.dtype}, not int64 words")
        return self._words_at(region.name, 0, owner)

    def _record(self, header: Header, call: CallId, peer: int, to: int | None = None) -> np.ndarray:
        """The words of `peer`'s record of `header` (an inbox's row `peer` lives in `to`'s memory)."""
        half = _half(header.double, call)
        if header.inbox:
            return self._words_at(header.name, half, self.rank if to is None else to)[peer]
        return self._words_at(header.name, half, peer)

    # -- publish and read -------------------------------------------------------------------------

    def publish(
        self, header: Header, call: CallId, values: Mapping[str, int | Iterable[int]], to: int | None = None
    ) -> None:
        if header.inbox == (to is None):
            raise ValueError(f"header {header.name}: an inbox needs `to`, an own record must not have it")
        record = self._record(header, call, self.rank, to)
        at = 1
        for field in header.fields:
            if field.name in values:
                record[at : at + field.words] = values[field.name]
            at += field.words
        record[0] = call.epoch  # everything above, and all payload written before, is visible from here on
        self.ring(to)

    def stamped(self, header: Header, call: CallId, peer: int) -> bool:
        return bool(self._record(header, call, peer)[0] == call.epoch)

    def read(self, header: Header, call: CallId, peer: int) -> Record:
        bounds = self._bounds.get(header)
        if bounds is None:
            bounds = self._bounds[header] = _Bounds.of(header)
        words = self._record(header, call, peer)[1:].copy()  # one snapshot: checked values cannot change
        if ((words < bounds.lo_W) | (words > bounds.hi_W)).any():
            field, value = bounds.first_bad(words)
            raise self.bad_data(call, peer, complaint(header, field, peer, value))
        listed = words.tolist()
        return {
            f.name: listed[at] if f.length is None else words[at : at + f.length]
            for f, at in zip(header.fields, bounds.starts, strict=True)
        }

    def read_all(self, header: Header, call: CallId, peers: Sequence[int]) -> Record:
        bounds = self._bounds.get(header)
        if bounds is None:
            bounds = self._bounds[header] = _Bounds.of(header)
        words_PW = np.stack([self._record(header, call, p)[1:] for p in peers])  # a snapshot
        bad_PW = (words_PW < bounds.lo_W) | (words_PW > bounds.hi_W)
        if bad_PW.any():
            at = int(np.flatnonzero(bad_PW.any(axis=1))[0])
            field, value = bounds.first_bad(words_PW[at])
            raise self.bad_data(call, peers[at], complaint(header, field, peers[at], value))
        return {
            f.name: words_PW[:, at] if f.length is None else words_PW[:, at : at + f.length]
            for f, at in zip(header.fields, bounds.starts, strict=True)
        }

    # -- waiting ----------------------------------------------------------------------------------

    def _waiter(self, phase: str, call: CallId, yields: int = YIELD_POLLS) -> Waiter:
        self._current_seq, self._current = call.seq, (call, phase)
        return Waiter(
            phase,
            self.timeout_s,
            self._peer_gone,
            self._aborted,
            self._memory.sleep,
            lambda error: self._gave_up(call, error),
            yields,
            call.timers,
        )

    def sleeper(self, phase: str, call: CallId) -> Waiter:
        """The wait of a compiled half that returned still waiting: it spun and yielded already, so
        each `pause` sleeps on the doorbell at once (under the deadline and the same peer checks)."""
        return self._waiter(phase, call, yields=0)

    def arrivals(self, header: Header, call: CallId, peers: Iterable[int], phase: str) -> Iterator[list[int]]:
        records = {p: self._record(header, call, p) for p in peers}
        waiter: Waiter | None = None
        while records:
            ready = [p for p, rec in records.items() if rec[0] == call.epoch]  # in `peers`' order
            if ready:
                for p in ready:
                    del records[p]
                yield ready
            elif records:
                waiter = waiter or self._waiter(phase, call)
                waiter.pause(list(records))

    def landed(self, header: Header, call: CallId, peers: Iterable[int], phase: str) -> Iterator[int]:
        for batch in self.arrivals(header, call, peers, phase):
            yield from batch

    def wait_landed(self, header: Header, call: CallId, peers: Iterable[int], phase: str) -> None:
        for _ in self.arrivals(header, call, peers, phase):
            pass

    def wait(self, phase: str, call: CallId, peers: Iterable[int], ready: Callable[[int], bool]) -> None:
        peers = list(peers)
        self.check_member(phase, peers)  # before a barrier or a put into peers' memory
        pending = [p for p in peers if not ready(p)]
        waiter = self._waiter(phase, call) if pending else None
        while pending:
            waiter.pause(pending)
            pending = [p for p in pending if not ready(p)]

    def ring(self, peer: int | None = None) -> None:
        if peer is not None:
            if peer != self.rank:
                self._memory.ring(peer)
            return
        for p in range(self.num_ranks):
            if p != self.rank:
                self._memory.ring(p)

    # -- barrier and aborts -----------------------------------------------------------------------

    def barrier(self, phase: str, call: CallId) -> None:
        """Each rank raises its barrier word to a target derived from the call, then waits for all.

        The target comes from the call and the barrier's place in it, not from a
        running count, so a call that some ranks abandoned cannot shift later
        barriers; a peer that abandoned this call is named by its abort notice.
        """
        target = self.barrier_target(phase, call)
        self._ctl[self.rank][CTL_BARRIER] = target
        self.ring()
        others = [r for r in self.live if r != self.rank]
        ctl = self._ctl
        self.wait(
            phase, call, others, lambda r: ctl[r][CTL_BARRIER] >= target and not self._notice(r, call.seq)
        )

    def barrier_target(self, phase: str, call: CallId) -> int:
        """The value every rank raises its barrier word to at the next barrier of `call`."""
        if call.seq != self._barrier_seq:
            self._barrier_seq, self._barrier_step = call.seq, 0
        self._barrier_step += 1
        if self._barrier_step >= BARRIERS_PER_CALL:
            raise RuntimeError(f"{phase}: more than {BARRIERS_PER_CALL - 1} barriers in one call")
        return call.seq * BARRIERS_PER_CALL + self._barrier_step

    def control_words(self, call: CallId) -> tuple[np.ndarray, np.ndarray]:
        """(barrier int64 [R], notice int64 [R]): the addresses of every rank's barrier word and of its
        abort notice for `call`, for a compiled barrier (a notice's top bits hold the seq it is for)."""
        return self._ctl_at + 8 * CTL_BARRIER, self._ctl_at + 8 * (CTL_ABORTS + call.seq % ABORT_RING)

    def _notice(self, peer: int, seq: int) -> tuple[int, int] | None:
        """(cause, culprit) if `peer` aborted call `seq`, else None."""
        got_seq, cause, culprit = unpack_notice(int(self._ctl[peer][CTL_ABORTS + seq % ABORT_RING]))
        return (cause, culprit) if got_seq == seq else None

    def _aborted(self, peer: int) -> AbortNotice | None:
        """Peer's notice if it aborted the current call (words read from a peer: checked); first,
        PeerDataError if any live rank began another call of this seq (see `begin`)."""
        if self._current is not None:
            self.check_in_step(*self._current)
        found = self._notice(peer, self._current_seq)
        return self._why(*found) if found is not None else self._left_behind(peer)

    def _why(self, cause: int, culprit: int, earlier: int | None = None) -> AbortNotice:
        """The notice of a peer that aborted this call, or the `earlier` one this rank completed."""
        lead = "" if earlier is None else f"it failed call #{earlier}, which this rank completed: "
        if cause not in BLAME or not 0 <= culprit < self.num_ranks:
            return AbortNotice(f"{lead}it rejected its input or failed; see that rank's error")
        return AbortNotice(f"{lead}it gave up because rank {culprit} {BLAME[cause]}", culprit, cause)

    def _left_behind(self, peer: int) -> AbortNotice | None:
        """Peer's notice for an earlier call this rank completed, while the peer has not begun the
        current one: it raised where this rank did not (bad data only it received, or a check only
        it made), so it is out of step and will not join this call. Calls up to the latest mask do
        not count: masking put the ranks back in step after them; nor does a peer's rejection of its
        own input, after which it may call again (a rank that completed needed nothing from it).
        Words read from a peer: checked."""
        seq = self._current_seq
        if unpack_call(int(self._ctl[peer][CTL_CALLS + seq % CALL_RING]))[0] == seq:
            return None  # it began this call: it takes part
        for earlier in range(seq - 1, max(seq - ABORT_RING, self._resumed_after, -1), -1):
            found = self._notice(peer, earlier)
            if found is not None and found[0] in BLAME and self._notice(self.rank, earlier) is None:
                return self._why(*found, earlier)
        return None

    def _gave_up(self, call: CallId, error: UbepError) -> None:
        """A wait of ours failed: pass the blame on, so peers waiting on us fail fast too."""
        if isinstance(error, CommTimeoutError):
            blamed = error.dead_peers or error.peers
            self.abort(call, CAUSE_DEAD if error.dead_peers else CAUSE_SILENT, blamed[0])
        elif isinstance(error, PeerAbortedError) and error.culprit is not None:
            self.abort(call, error.notice.cause, error.culprit)
        elif isinstance(error, PeerAbortedError):  # the peer gave up on its own: it is the one to name
            self.abort(call, CAUSE_ABORTED, error.peer)
        else:
            self.abort(call)

    def begin(self, call: CallId) -> None:
        """Record that this rank began `call` (its kind and per-kind number), for peers' waits; first,
        where this rank abandoned the call before, wait until every peer has left the calls before
        that one (`_after_abandoned`)."""
        if self._notice(self.rank, call.seq - 1) is not None and call.seq - 1 > self._resumed_after:
            self._after_abandoned(call)
        word = (call.seq << 32) | ((call.epoch & 0xFFFFFF) << 8) | KINDS.get(call.kind, 0)  # per call: inline
        self._ctl[self.rank][CTL_CALLS + call.seq % CALL_RING] = word

    def _after_abandoned(self, call: CallId) -> None:
        """Wait until every live peer began or abandoned the call before `call` (or began `call`), so
        it has left every call before that: this rank abandoned that call, so never heard from them in
        it. A call it completed proves as much (its peers had begun it), and so lets the next call of a
        kind write over the half the one before used; an abandoned one does not, and a peer slow in
        the call before (a pull protocol: still reading this rank's rows there) would find them
        overwritten and fail a call every other rank completed (issue 45, item 5)."""
        before = call.seq - 1

        def left(peer: int) -> bool:
            began = unpack_call(int(self._ctl[peer][CTL_CALLS + before % CALL_RING]))[0] == before
            now = unpack_call(int(self._ctl[peer][CTL_CALLS + call.seq % CALL_RING]))[0] == call.seq
            return began or now or self._notice(peer, before) is not None

        others = [r for r in self.live if r != self.rank]
        self.wait(f"{call.kind} (peers leaving call #{before - 1})", call, others, left)

    def check_in_step(self, call: CallId, phase: str) -> None:
        """Raise PeerDataError (and tell the peers) if a live rank began another call of this seq
        than this rank did (another kind, or another number of its kind): the ranks' call
        sequences went apart (a rank skipped or added a call, here or earlier), so this call can
        never complete. The call as begun is read from the ring: a protocol may wait under the
        call's `exact` identity."""
        mine = unpack_call(int(self._ctl[self.rank][CTL_CALLS + call.seq % CALL_RING]))
        if mine[0] != call.seq or not mine[2]:
            return  # a wait of no call this rank began (or of a call of no known kind)
        calls = {r: unpack_call(int(self._ctl[r][CTL_CALLS + call.seq % CALL_RING])) for r in self.live}
        began = {r: c for r, c in calls.items() if c[0] == call.seq and c[2]}  # peers behind: not yet
        other = [r for r, c in began.items() if c[1:] != mine[1:]]
        if not other:
            return
        self.abort(call, CAUSE_OUT_OF_STEP, other[0])
        by_call: dict[tuple[int, int], list[int]] = {}
        for r, (_, number, kind) in sorted(began.items()):
            by_call.setdefault((kind, number), []).append(r)
        said = ", ".join(
            f"rank(s) {', '.join(map(str, ranks))} called {METHODS[kind]} #{number}"
            for (kind, number), ranks in by_call.items()
        )
        raise PeerDataError(f"{phase}: the ranks' calls #{call.seq} differ: {said}")

    def abort(self, call: CallId, cause: int = CAUSE_OWN, culprit: int = -1) -> None:
        if self._ctl and self._notice(self.rank, call.seq) is None:
            self._ctl[self.rank][CTL_ABORTS + call.seq % ABORT_RING] = pack_notice(call.seq, cause, culprit)
            self.ring()

    def bad_data(self, call: CallId, culprit: int, message: str) -> PeerDataError:
        self.abort(call, CAUSE_BAD_DATA, culprit)
        return PeerDataError(message)

    # -- membership -------------------------------------------------------------------------------

    def mask(self, ranks: Collection[int], seq: int) -> int:
        """Collective among the ranks that stay: stop waiting for `ranks` (every rank left out: dead,
        or gone, those masked before included).

        Every staying rank passes the same ranks (PeerDataError names one that
        differs) and the seq of the last call it started; they may have failed
        at different calls around a death, so all resume after the largest.
        Returns that seq. Later waits and barriers involve `live` ranks only.
        """
        gone = set(ranks)
        stay = [r for r in range(self.num_ranks) if r not in gone]
        g, half = self._publish(seq, gone)
        waiter = Waiter(
            f"masking rank(s) {sorted(gone)} (the staying ranks agree)",
            self.timeout_s,
            self._peer_gone,
            lambda peer: None,  # aborted calls from before the mask are expected, and do not matter here
            self._memory.sleep,
        )
        pending = [r for r in stay if r != self.rank]
        while pending := [r for r in pending if self._members[r][half][0] != g]:
            waiter.pause(pending)
        for r in stay:
            theirs = {p for p in range(self.num_ranks) if self._members[r][half][2 + p]}
            if theirs != gone:
                message = f"mask: rank {r} masks rank(s) {sorted(theirs)}, this rank {sorted(gone)}"
                raise PeerDataError(message)
        self.live = tuple(stay)
        self.live_R = np.array(stay, dtype=np.int64)
        self._resumed_after = max(int(self._members[r][half][1]) for r in stay)
        return self._resumed_after

    # -- rejoining ---------------------------------------------------------------------------------

    def introduce(self, process: ProcessId, secret: np.ndarray) -> None:
        """Write who this rank's process is, and the job's doorbell secret (int64 [KEY_WORDS]), into
        its control block: where peers learn a rejoined rank's process, and a rejoining one the secret."""
        ctl = self._ctl[self.rank]
        ctl[CTL_KEY : CTL_KEY + KEY_WORDS] = secret
        ctl[CTL_ID : CTL_ID + ID_WORDS] = (process.pid, process.pid_ns, process.start)

    def identity(self, rank: int) -> ProcessId | None:
        """Rank `rank`'s process as its control block says (None: never written)."""
        pid, pid_ns, start = (int(w) for w in self._ctl[rank][CTL_ID : CTL_ID + ID_WORDS])
        return ProcessId(pid, pid_ns, start) if pid > 0 else None

    def admissions(self, seq: int, boundary: bool) -> frozenset[int]:
        """Before this rank begins call `seq`, ranks being masked: where `boundary` (a call that takes
        no handle: a dispatch routed anew, a low-latency dispatch), the masked ranks every staying rank
        takes back in before it (`admit`): those the leader announced for a call up to `seq`. The
        leader (the lowest live rank) first turns each live joiner's request into an announcement
        for call seq + ADMIT_AHEAD (see `ADMIT_AHEAD`), at any call."""
        leader = self.live[0]
        if self.rank == leader:
            asked = self._joins[self.rank][ASKED]
            for r in np.flatnonzero(asked).tolist():
                if r in self.live:
                    continue  # the old process is not masked yet: the next failed call masks it
                pid, process = int(asked[r]), self.identity(r)
                asked[r] = 0  # read once: a joiner that dies is not announced again
                if process is not None and process.pid == pid and not process.is_gone():
                    self._joins[self.rank][ANNOUNCED][r] = seq + ADMIT_AHEAD
        if not boundary:
            return frozenset()
        told = self._joins[leader][ANNOUNCED].copy()  # read once
        due = [r for r in np.flatnonzero((told > 0) & (told <= seq)).tolist() if r not in self.live]
        joiners = frozenset(r for r in due if self._handled.get(r) != int(told[r]))
        self._handled.update((r, int(told[r])) for r in joiners)  # each announcement is acted on once
        return joiners

    def admit(self, ranks: Collection[int], seq: int) -> frozenset[int]:
        """Collective among the staying ranks and the joiners `ranks`, before call `seq`: take them
        back into every later call; all resume after call seq - 1. Returns the ranks taken in: none
        where a joiner died before it agreed (then every staying rank masks the joiners again)."""
        joiners = frozenset(ranks)
        peers = list(self._peers)
        for r in joiners:
            peers[r] = self.identity(r)
        self._peers = tuple(peers)
        gone = set(range(self.num_ranks)) - set(self.live) - joiners
        if self._agree(gone, seq - 1, f"taking rank(s) {sorted(joiners)} back in", joiners):
            return joiners
        self.mask(gone | joiners, seq - 1)  # every staying rank saw the same joiner die: it decides alike
        return frozenset()

    def join(self, deadline_s: float, stamp: Callable[[str], None]) -> Agreement:
        """This process restarts a masked rank: ask every live rank to take it in, wait (up to
        `deadline_s` seconds) for the leader's announcement and the staying ranks' agreement, and
        agree; `stamp(stage)` as each of the two ends. Returns the ranks still masked and the seq of
        the call all resume after."""
        others = [r for r in range(self.num_ranks) if r != self.rank]
        alive = [r for r in others if (p := self.identity(r)) is not None and not p.is_gone()]
        if not alive:
            raise RejoinError(f"rank {self.rank} rejoining: no other rank of the group is alive")
        before = {r: int(self._joins[r][ANNOUNCED][self.rank]) for r in alive}
        self._peers = tuple(self.identity(r) for r in range(self.num_ranks))
        for r in alive:
            self._joins[r][ASKED][self.rank] = os.getpid()
            self.ring(r)
        waiter = Waiter(
            f"rank {self.rank} rejoining (waiting for the staying ranks' next call)",
            deadline_s,
            lambda peer: False,  # a dead rank is the others' to mask; the leader's next call announces
            lambda peer: None,
            self._memory.sleep,
        )
        while True:
            told = [r for r in alive if int(self._joins[r][ANNOUNCED][self.rank]) != before[r]]
            if told:
                break
            waiter.pause(alive)
        leader = told[0]
        after = int(self._joins[leader][ANNOUNCED][self.rank])
        record = None
        while record is None:  # the leader's record that takes this rank in: its generation and set
            records = self._members[leader]
            latest = (records[0] if records[0, 0] > records[1, 0] else records[1]).copy()
            if latest[0] > 0 and not latest[2 + self.rank] and int(latest[1]) >= after - 1:
                record = latest
            else:
                waiter.pause([leader])
        stamp("survivors' dispatch")  # the leader announced it, and its record takes this rank in
        self.generation = int(record[0]) - 1
        gone = {p for p in range(self.num_ranks) if record[2 + p]}
        told = self._joins[leader][ANNOUNCED]
        joiners = frozenset(
            r for r in range(self.num_ranks) if r not in gone and 0 < told[r] <= record[1] + 1
        )
        self._handled.update((r, int(told[r])) for r in joiners)
        self._peers = tuple(self.identity(r) for r in range(self.num_ranks))  # joining with it: new ones
        if not self._agree(gone, int(record[1]), f"rank {self.rank} rejoining", joiners - {self.rank}):
            raise MaskedOutError(
                f"rank {self.rank} rejoining: a rank joining with it died, so the staying ranks masked "
                "both again; restart this process to rejoin"
            )
        stamp("agreed")
        return Agreement(frozenset(gone), self._resumed_after, True)

    def _publish(self, word: int, gone: Collection[int]) -> tuple[int, int]:
        """Write this rank's next membership record (`word`: a seq or an agreed value, and the `gone`
        flags) and ring every rank outside `gone`; returns the record's generation and half."""
        self.generation += 1
        self._write_record(self.generation, word, gone)
        return self.generation, self.generation % 2

    def _write_record(self, g: int, word: int, gone: Collection[int]) -> None:
        """Write this rank's membership record of generation `g` (in half g % 2) and ring every rank
        outside `gone`; written again with the same `g` where `gone` grows inside one agreement."""
        record = self._members[self.rank][g % 2]
        record[1] = word
        record[2:] = [r in gone for r in range(self.num_ranks)]
        record[0] = g  # last: the record is complete once a peer sees the generation
        for r in range(self.num_ranks):
            if r not in gone:
                self.ring(r)

    def _agree(self, gone: set[int], seq: int, phase: str, joiners: Collection[int]) -> bool:
        """`mask`'s agreement on `gone` after call `seq` (every rank outside it publishes the same
        record of the next generation, and waits for every other one's); False where one of
        `joiners` died before publishing (re-read once it is seen dead: a record published before
        the death is seen by every rank, so all of them decide alike)."""
        stay = [r for r in range(self.num_ranks) if r not in gone]
        g, half = self._publish(seq, gone)
        waiter = Waiter(phase, self.timeout_s, self._peer_gone, lambda peer: None, self._memory.sleep)
        pending = [r for r in stay if r != self.rank]
        while pending := [r for r in pending if self._members[r][half][0] != g]:
            try:
                waiter.pause(pending)
            except CommTimeoutError as late:
                dead = set(late.dead_peers)
                if not dead or not dead <= set(joiners):
                    raise
                if any(self._members[r][half][0] != g for r in dead):
                    return False
                waiter = Waiter(phase, self.timeout_s, self._peer_gone, lambda peer: None, self._memory.sleep)
        for r in stay:
            theirs = {p for p in range(self.num_ranks) if self._members[r][half][2 + p]}
            if theirs != gone:
                raise PeerDataError(
                    f"{phase}: rank {r} leaves out rank(s) {sorted(theirs)}, this rank {sorted(gone)}"
                )
        self.live = tuple(stay)
        self.live_R = np.array(stay, dtype=np.int64)
        self._resumed_after = max(int(self._members[r][half][1]) for r in stay)
        return True

    def agree_to_mask(self, error: Exception, seq: int) -> Agreement | None:
        """Inside call `seq`, failed with `error`: the staying ranks agree on whom to leave out.

        Each publishes what it suspects (`failed_peers`) in its next membership record, and
        takes in every record of a rank it does not suspect: the union grows until every
        staying rank's record holds the same ranks. A rank that dies meanwhile joins the
        union; a rank that finds itself in it was masked by the others (MaskedOutError).
        """
        suspects = failed_peers(error)
        if not suspects:
            return None
        gone = set(suspects) | (set(range(self.num_ranks)) - set(self.live))
        g = self.generation + 1
        self._write_record(g, seq, gone)
        waiter: Waiter | None = None  # one deadline while the union does not grow
        while True:
            known = len(gone)
            pending = self._disagreeing(g, gone)
            if self.rank in gone:
                raise MaskedOutError(
                    f"{getattr(error, 'phase', 'call')}: the other ranks masked rank {self.rank} out of "
                    "the group (they saw it die or go silent); it takes part in no further call"
                )
            if len(gone) > known:
                self._write_record(g, seq, gone)
                waiter = None
                continue
            if not pending:
                break
            if waiter is None:
                waiter = Waiter(
                    f"agreeing to mask rank(s) {sorted(gone)} inside the call",
                    self.timeout_s,
                    self._peer_gone,
                    lambda peer: None,  # every staying rank aborted the failed call: expected here
                    self._memory.sleep,
                )
            try:
                waiter.pause(pending)
            except CommTimeoutError as late:  # died, or fell silent, while the others agreed
                gone |= set(late.dead_peers or late.peers)
                self._write_record(g, seq, gone)  # the union grew: the others wait for a record holding it
                waiter = None
        stay = [r for r in range(self.num_ranks) if r not in gone]
        seqs = {int(self._members[r][g % 2][1]) for r in stay}
        self.generation = g
        self.live, self.live_R = tuple(stay), np.array(stay, dtype=np.int64)
        self._resumed_after = max(seqs)
        return Agreement(frozenset(gone), max(seqs), seqs == {seq}, frozenset(seqs))

    def agree(self, value: int, phase: str) -> dict[int, int]:
        """Every staying rank's `value`: each publishes it in its next membership record (the masked
        flags unchanged, so a writer's membership check reads the same), then reads the others'."""
        gone = set(range(self.num_ranks)) - set(self.live)
        g, half = self._publish(value, gone)
        waiter = Waiter(
            f"{phase} (the staying ranks agree)",
            self.timeout_s,
            self._peer_gone,
            lambda peer: None,  # aborted calls from before are over
            self._memory.sleep,
        )
        pending = [r for r in self.live if r != self.rank]
        while pending := [r for r in pending if self._members[r][half][0] != g]:
            waiter.pause(pending)
        return {r: int(self._members[r][half][1]) for r in self.live}

    def _disagreeing(self, g: int, gone: set[int]) -> list[int]:
        """The staying peers whose record of generation `g` does not hold `gone` yet; adds to `gone`
        every rank their records suspect."""
        pending = []
        for r in range(self.num_ranks):
            if r in gone or r == self.rank:
                continue
            theirs = self._members[r][g % 2]
            if theirs[0] != g:
                pending.append(r)
                continue
            suspected = {p for p in range(self.num_ranks) if theirs[2 + p]}
            gone |= suspected
            if suspected != gone:
                pending.append(r)
        return pending

    def check_member(self, phase: str, peers: Iterable[int] | None = None) -> None:
        mine = self.generation
        for p in self.live if peers is None else peers:
            records = self._members[p]
            latest = records[0] if records[0, 0] > records[1, 0] else records[1]
            if latest[0] > mine and latest[2 + self.rank]:
                raise MaskedOutError(
                    f"{phase}: rank {p} and the others masked rank {self.rank} out of the group "
                    "(they saw it die or go silent, or it left); it takes part in no further call"
                )

    # -- lifetime ---------------------------------------------------------------------------------

    def learn_peers(self, peers: Sequence[ProcessId | None]) -> None:
        """Who each rank's process is (None: not a process of its own, e.g. a thread), so that
        waits notice a peer's exit; identities, not bare pids, which mean nothing across PID
        namespaces (see `ProcessId`)."""
        self._peers = tuple(peers)

    def _peer_gone(self, peer: int) -> bool:
        process = self._peers[peer]
        return process is not None and process.is_gone()

    def close(self) -> None:
        self._ctl, self._members = [], []
        self._views, self._numpy = {}, {}
        self._memory.close()


@dataclass(frozen=True, slots=True)
class _Bounds:
    """A header's field bounds as word vectors, for one vectorised check per read."""

    lo_W: np.ndarray
    hi_W: np.ndarray
    starts: tuple[int, ...]  # each field's first word, after the stamp
    fields: tuple[Field, ...]

    @classmethod
    def of(cls, header: Header) -> _Bounds:
        lo, hi, starts, at = [], [], [], 0
        for f in header.fields:
            starts.append(at)
            lo += [f.lo] * f.words
            hi += [np.iinfo(np.int64).max if f.hi is None else f.hi] * f.words
            at += f.words
        return cls(np.array(lo, dtype=np.int64), np.array(hi, dtype=np.int64), tuple(starts), header.fields)

    def first_bad(self, words: np.ndarray) -> tuple[Field, int]:
        """The first field holding an out-of-bounds word, and that word."""
        at = int(np.flatnonzero((words < self.lo_W) | (words > self.hi_W))[0])
        field = next(f for f, start in zip(self.fields, self.starts, strict=True) if at < start + f.words)
        return field, int(words[at])


def failed_peers(error: Exception) -> frozenset[int]:
    """The ranks `error` says failed this call: dead, stopped or silent past the deadline (a
    `CommTimeoutError`'s), or the rank a peer gave up on for that reason (its abort notice's
    culprit); empty for any other error (bad data, a rejected input, this rank masked out)."""
    if isinstance(error, CommTimeoutError):
        return frozenset(error.dead_peers or error.peers)
    if isinstance(error, PeerAbortedError) and error.notice.cause in (CAUSE_DEAD, CAUSE_SILENT):
        return frozenset({error.culprit}) if error.culprit is not None else frozenset()
    return frozenset()


def complaint(header: Header, field: Field, peer: int, value: int) -> str:
    """What a bad header value means, in the words of the protocol that declared it."""
    said = field.says or f"published {field.name}={{value}}, outside [{{lo}}, {{hi}}]"
    return f"{header.phase or header.name}: rank {peer} " + said.format(value=value, lo=field.lo, hi=field.hi)


def _half(double: bool, call: CallId | None) -> int:
    if not double:
        return 0
    if call is None:
        raise ValueError("a double-buffered block needs the call whose half to use")
    return call.parity

"""The fabric floor: how bytes reach a rank on another host.

    protocol (ubep across hosts) -> [fabric] -> the wire (gloo: TCP; nixl: UCX over TCP, InfiniBand, EFA)

A fabric carries *messages on lanes*. A lane is one kind of message (a
dispatch's rows, a combine's rows, ...) between every pair of ranks of the
group: each rank has, for every peer, an inbox of the lane's size per buffer
half (the call's seq parity), registered once at construction. `outbox` gives
this rank's message of a call to one peer to fill in place (rows are gathered
straight into it), and `send` sends it: its bytes, then the notice that they
are there (data as flag). A message is int64 header words chosen by the
protocol (so counts and routing travel with the rows), then its payload bytes.
`arrivals` yields each peer's message of a call as it lands, in arrival order,
under the Buffer's deadline, with the dead-peer and abort checks; `release`
hands the inbox back for a later call. No call of a fabric is collective:
nothing waits for a peer that has nothing to send this rank.

Every message is framed with the call it belongs to (seq, kind): a message of
an older call (one this rank gave up on) is dropped, never taken for a later
one, and a peer ahead of this rank is named. A rank that gives up on a call
tells its peers at once (`abort`), as the shared-memory transport does.

`Fabric` holds what every engine shares, once: the wait for a call's messages,
the check of each frame against its lane, dropping an abandoned call's message,
the mask rounds. An engine (`gloo`, `nixl`) says how a message is put and how
one is seen to land, through a few hooks (`_landed_frame`, `_contents`, `_drop`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from ubep.calls import KINDS, METHODS, CallId
from ubep.errors import CommTimeoutError, MaskedOutError, PeerDataError
from ubep.faults import NO_FAULTS
from ubep.transport.base import Agreement
from ubep.waiting import AbortNotice, PeerAbortedError, Waiter

MASK_LANE = "mask"  # every engine's own lane: the rounds of `mask_ranks`
Slot = tuple[int, int, int]  # (lane, peer, half): where one peer's message of one call parity lands
Frame = tuple[int, int, int, int]  # (seq, kind code, header words, payload bytes) of a landed message


@dataclass(frozen=True, slots=True)
class Lane:
    """One kind of message: at most `words` int64 header words and `nbytes` payload bytes, from every
    peer to every peer (or to and from `peers` only), double-buffered by the call's seq parity (calls
    s and s + 1 may overlap)."""

    name: str
    words: int
    nbytes: int
    peers: tuple[int, ...] | None = None  # None: every rank of the group


@dataclass(slots=True)
class Outgoing:
    """A message being written: fill `header` (int64 [words]) and `payload` (uint8 [nbytes]) in place,
    then `Fabric.send` it. `key` is the engine's own (where it goes)."""

    header: torch.Tensor
    payload: torch.Tensor
    key: object


@dataclass(frozen=True, slots=True)
class Message:
    """One peer's message of one call, as it landed: its header words (a copy, int64) and its payload
    (a view of this rank's inbox, valid until `release`)."""

    peer: int
    header: torch.Tensor  # int64 [words]
    payload: torch.Tensor  # uint8 [nbytes sent]


class Fabric(ABC):
    """One rank's end of the fabric: its inboxes, its puts, its waits.

    What every engine shares is here, once: the wait for a call's messages (`arrivals`), the check of
    each frame against its lane, dropping a message of a call this rank gave up on, and the mask
    rounds. An engine says how a message is put (`outbox`, `send`, `abort`'s notice) and how one is
    seen to land, through the hooks below (`_landed_frame`, `_contents`, `_drop`, ...)."""

    name: str

    def __init__(self, rank: int, num_ranks: int, lanes: Sequence[Lane], timeout_s: float):
        self.rank, self.num_ranks, self.timeout_s = rank, num_ranks, timeout_s
        lanes = (*lanes, mask_lane(num_ranks))  # the fabric's own: `mask` rounds
        self.lanes = {lane.name: i for i, lane in enumerate(lanes)}
        self._lanes = tuple(lanes)
        self.live = tuple(range(num_ranks))  # the ranks taking part, ascending (all, until some are masked)
        self.peers = [p for p in range(num_ranks) if p != rank]
        self._generation = 0  # mask rounds so far
        self._notices: dict[tuple[int, int, bool], AbortNotice] = {}  # `notice_key` -> its notice
        self._abandoned: set[int] = set()  # calls this rank gave up on (their messages are dropped)
        self._bad: dict[int, str] = {}  # peer -> what it sent outside a message that this rank cannot read
        self.faults = NO_FAULTS  # tests: a "cut" plan's peers, which nothing this rank sends reaches

    # -- the interface ----------------------------------------------------------------------------

    @abstractmethod
    def outbox(self, lane: str, peer: int, call: CallId, words: int, nbytes: int) -> Outgoing:
        """This rank's message of `call` on `lane` to `peer`, to fill: `words` header words, `nbytes`
        payload bytes (the lane's limits at most). Its memory is the engine's (registered)."""

    @abstractmethod
    def send(self, out: Outgoing) -> None:
        """Send a filled message; returns at once: no sender waits for its receiver."""

    def arrivals(
        self,
        lane: str,
        call: CallId,
        peers: Iterable[int],
        phase: str,
        other_call: Callable[[int, torch.Tensor], None] | None = None,
    ) -> Iterator[Message]:
        """Each of `peers`' messages of `call` on `lane`, once, as it lands (arrival order). Raises
        CommTimeoutError naming the silent or dead peers at the deadline, PeerAbortedError when a
        pending peer gave up on the call, PeerDataError when a peer is in another call. A pending
        peer's message of the same seq on another lane (a call of another kind) goes to
        `other_call(peer, its header)`, which raises in the protocol's words."""
        i, half = self.lanes[lane], call.seq % 2
        pending = [p for p in peers if p != self.rank]
        notice = self._notice_of(call)
        waiter = self._waiter(phase, notice)
        while pending:
            self._progress()
            landed = []
            for p in pending:
                if (fault := self._bad.pop(p, None)) is not None:
                    raise PeerDataError(f"{phase}: rank {p} {fault}", culprit=p)
                while (frame := self._frame((i, p, half), phase)) is not None:
                    seq, kind, words, nbytes = frame
                    if not is_this_call(phase, call, p, seq, kind, notice):
                        self._drop((i, p, half))  # an older call's message: dropped
                        continue
                    landed.append((p, words, nbytes))
                    break
            for p, words, nbytes in landed:
                pending.remove(p)
                header, payload = self._contents((i, p, half), words, nbytes)
                yield Message(p, header.clone(), payload)  # the header read once: checked, then used
            if pending and not landed:
                self._other_calls(i, call, pending, phase, other_call)
                self._check_connections(phase, pending, notice)
                self._pause(waiter, pending)
        self._settle(i, call, waiter)

    @abstractmethod
    def release(self, lane: str, peer: int, call: CallId) -> None:
        """This rank is done with `peer`'s message of `call` on `lane`: its inbox may take a later one."""

    def begin(self, call: CallId) -> None:
        """This rank begins `call` (before its first message of it): inboxes still holding an older
        call's message, one this rank gave up on, are freed for the peers' later messages. (A message
        of a call whose receive half is still to come, a low-latency hook, stays.)"""
        self._progress()
        for slot in self._occupied():
            frame = self._landed_frame(slot)
            if frame is not None and frame[0] in self._abandoned:
                self._drop(slot)

    def sent(self) -> None:
        """Before a call returns: its messages have left this process (engines that queue them for a
        thread of their own), so a rank that dies after completing a call took none of them with it.
        Else a peer waiting for one fails that call while the others fail the next one, and the
        staying ranks, agreeing on different calls, all raise instead of masking the dead rank."""
        return None

    def abort(self, call: CallId, culprit: int | None = None, rejected: bool = False) -> None:
        """Tell every peer that this rank gives up on `call`, blaming `culprit` (None: itself;
        `rejected`: it rejected its own input for the call, before sending anything). Once a call."""
        if call.seq in self._abandoned:
            return
        self._abandoned.add(call.seq)
        self._tell_abort(0 if culprit is None else culprit + 1, 2 * KINDS[call.kind] + rejected, call.seq)

    def mask(self, ranks: Iterable[int], seq: int) -> int:
        """Collective among the ranks that stay (over the fabric): leave `ranks` out of every later
        wait. `seq` is the last call this rank started; returns the largest any staying rank started,
        after which they all continue (as `ubep.transport.base.Transport.mask`)."""
        self._generation += 1
        self.live, latest = agree_on_mask(self, ranks, seq, self._generation)
        return latest

    def agree_to_mask(self, error: Exception, seq: int) -> Agreement | None:
        """Inside call `seq`, failed with `error` (on_peer_failure="mask"): the staying ranks agree on
        the union of the ranks each found dead, silent, or blamed by a peer's abort notice, in mask
        rounds over the fabric (`agree_on_union`); None where `error` names no such rank."""
        suspects = failed_peers(error)
        if not suspects:
            return None
        gone = frozenset(suspects) | frozenset(range(self.num_ranks)).difference(self.live)
        self.live, seqs, self._generation = agree_on_union(self, gone, seq, self._generation)
        gone = frozenset(range(self.num_ranks)).difference(self.live)
        return Agreement(gone, max(seqs), seqs == {seq}, seqs)

    def agree(self, value: int, phase: str) -> dict[int, int]:
        """Every staying rank's `value`, in one mask round over the fabric (`agree_on_values`), the
        masked ranks unchanged (`ubep.transport.base.Transport.agree`)."""
        self._generation += 1
        return agree_on_values(self, value, self._generation, phase)

    @abstractmethod
    def close(self) -> None:
        """Release every inbox and connection; idempotent."""

    # -- the engine's hooks -----------------------------------------------------------------------

    @abstractmethod
    def _landed_frame(self, slot: Slot) -> Frame | None:
        """(seq, kind, header words, payload bytes) of the message in `slot` (lane, peer, half) once
        all of it has landed, else None: as the peer framed it, unchecked (`_frame` checks it)."""

    @abstractmethod
    def _contents(self, slot: Slot, words: int, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(header int64 [words], payload uint8 [nbytes]): views of the landed message in `slot`."""

    @abstractmethod
    def _drop(self, slot: Slot) -> None:
        """Free `slot` for its peer's next message, the one in it unread (an older call's, or a bad one)."""

    @abstractmethod
    def _occupied(self) -> Iterable[Slot]:
        """The slots that may hold a landed message (a copy: the caller may drop some)."""

    @abstractmethod
    def _gone(self, peer: int) -> bool:
        """The Waiter's peer_gone: whether `peer` provably left (its process exited, its connection
        is lost)."""

    @abstractmethod
    def _notice_of(self, call: CallId) -> Callable[[int], AbortNotice | None]:
        """The Waiter's peer_abort for `call`: the notice a peer sent that it gave up on it."""

    @abstractmethod
    def _tell_abort(self, culprit: int, how: int, seq: int) -> None:
        """Send every peer an abort notice: culprit + 1 (0: this rank), 2 kind + rejected, seq."""

    def _progress(self) -> None:
        """Drive the engine once (take notices, complete transfers); each wait does so between pauses."""
        return None

    def _intact(self, slot: Slot) -> bool:
        """Whether the landed message in `slot` ends where its frame says (engines that can tell)."""
        return True

    def _lost_peers(self, pending: list[int]) -> tuple[list[int], list[int]]:
        """(those of `pending` whose connection failed, those of them whose process exited), for engines
        that name a lost connection at once rather than through `_gone`."""
        return [], []

    def _waiter(self, phase: str, notice: Callable[[int], AbortNotice | None]) -> Waiter:
        """The wait of one receive (`Waiter`: yields, then sleeps); an engine that can block on all its
        peers at once passes its own `block`."""
        return Waiter(phase, self.timeout_s, self._gone, notice)

    def _pause(self, waiter: Waiter, pending: list[int]) -> None:
        """Wait a while for `pending` (`Waiter.pause`: the deadline, dead peers, abort notices); an
        engine may reword what the waiter raises."""
        waiter.pause(pending)

    def _settle(self, lane: int, call: CallId, waiter: Waiter) -> None:
        """After every peer's message of `call` on `lane` is in: what the engine waits for before the
        receive half returns."""
        return None

    # -- shared -----------------------------------------------------------------------------------

    def _frame(self, slot: Slot, phase: str) -> Frame | None:
        """The landed message's frame, checked: out of its lane's bounds (or of the other half), or not
        ending where it says, the inbox is freed for the peer's next message and the peer is blamed."""
        frame = self._landed_frame(slot)
        if frame is None:
            return None
        seq, _, words, nbytes = frame
        if not self._in_bounds(slot, frame):
            limit = self._lanes[slot[0]]
            fault = (
                f"framed a message of call #{seq} in half {slot[2]} with {words} header words and "
                f"{nbytes} bytes (lane {limit.name!r}: at most {limit.words} and {limit.nbytes})"
            )
        elif not self._intact(slot):
            fault = f"sent a message of call #{seq} that does not end where its frame says ({nbytes} bytes)"
        else:
            return frame
        self._drop(slot)
        raise PeerDataError(f"{phase}: rank {slot[1]} {fault}", culprit=slot[1])

    def _in_bounds(self, slot: Slot, frame: Frame) -> bool:
        """Whether a frame's sizes fit its lane, and its seq the half it landed in."""
        limit, (seq, _, words, nbytes) = self._lanes[slot[0]], frame
        return 0 <= words <= limit.words and 0 <= nbytes <= limit.nbytes and seq % 2 == slot[2]

    def _other_calls(self, lane: int, call: CallId, pending: list[int], phase: str, other_call) -> None:
        """A pending peer's landed message of this seq on another lane: `other_call` raises on it."""
        if other_call is None:
            return
        for slot in self._occupied():
            if slot[0] == lane or slot[1] not in pending or (frame := self._frame(slot, phase)) is None:
                continue
            if frame[0] == call.seq:
                other_call(slot[1], self._contents(slot, frame[2], 0)[0].clone())

    def _check_connections(self, phase: str, pending: list[int], notice) -> None:
        """A pending peer whose connection failed is named now: by its abort notice where it sent one
        first, else as lost (or dead, where its process exited)."""
        lost, dead = self._lost_peers(pending)
        for p in lost:
            if (said := notice(p)) is not None:
                raise PeerAbortedError(phase, p, said)
        if lost:
            detail = "" if dead else "its connection to this rank closed"
            raise CommTimeoutError(phase, lost, self.timeout_s, dead, detail, lost=not dead)

    def _take_abort(self, peer: int, culprit: int, how: int, seq: int) -> None:
        """File `peer`'s abort notice (culprit + 1, 2 kind + rejected, seq), its words checked."""
        if not (0 <= culprit <= self.num_ranks and how // 2 in METHODS and seq > 0):
            self._bad[peer] = f"sent an abort notice this rank cannot read ({culprit}, {how}, {seq})"
            return
        self._notices[notice_key(peer, seq, how // 2)] = abort_notice(culprit - 1, how // 2, how % 2, seq)


def check_fits(lane: Lane, peer: int, call: CallId, words: int, nbytes: int) -> None:
    """Refuse a message larger than its lane (the peer's inbox was sized for the lane at construction),
    naming the lane and both sizes, before any byte of it is written or sent: sent, it would overrun
    the inbox, which the engine answers with a process abort (gloo) or a write past the region."""
    if not (0 <= words <= lane.words and 0 <= nbytes <= lane.nbytes):
        raise ValueError(
            f"{call.kind} (call #{call.seq}): a message of {words} header words and {nbytes} payload bytes "
            f"to rank {peer} exceeds the {lane.name!r} lane's {lane.words} words and {lane.nbytes} bytes, "
            "sized at construction from the Buffer's hidden, max_tokens_per_rank and max_topk"
        )


def mask_lane(num_ranks: int) -> Lane:
    """The lane a mask round runs on: the last call a rank started, then a flag per rank."""
    return Lane(MASK_LANE, 1 + num_ranks, 0)


def agree_on_mask(
    fabric: Fabric, ranks: Iterable[int], seq: int, generation: int
) -> tuple[tuple[int, ...], int]:
    """One mask round (`Fabric.mask`), over any engine: every staying rank tells every other the ranks it
    leaves out and the last call it started. Returns (the staying ranks, the last call any of them
    started); a staying rank that leaves out another set is named."""
    gone = set(ranks)
    stay = tuple(p for p in range(fabric.num_ranks) if p not in gone)
    call = CallId(generation, generation, MASK_LANE)
    flags = [int(r in gone) for r in range(fabric.num_ranks)]
    mine = torch.tensor([seq, *flags], dtype=torch.int64, device="cpu")
    for p in stay:
        if p != fabric.rank:
            out = fabric.outbox(MASK_LANE, p, call, mine.numel(), 0)
            out.header.copy_(mine)
            fabric.send(out)
    latest = seq
    for msg in fabric.arrivals(MASK_LANE, call, stay, "mask_ranks"):
        theirs = msg.header
        flags_ok = theirs.numel() == mine.numel() and bool(((theirs[1:] == 0) | (theirs[1:] == 1)).all())
        if not flags_ok or theirs[0] < 0:
            said = f"sent {theirs.numel()} words, not a call and {fabric.num_ranks} flags of 0 or 1"
            raise PeerDataError(f"mask_ranks: rank {msg.peer} {said}", culprit=msg.peer)
        if not torch.equal(theirs[1:], mine[1:]):
            masked = [r for r in range(fabric.num_ranks) if theirs[1 + r]]
            said = f"masks ranks {masked}, this rank {sorted(gone)}"
            raise PeerDataError(f"mask_ranks: rank {msg.peer} {said}")
        latest = max(latest, int(theirs[0]))
        fabric.release(MASK_LANE, msg.peer, call)
    return stay, latest


def agree_on_values(fabric: Fabric, value: int, generation: int, phase: str) -> dict[int, int]:
    """One mask round (`Fabric.agree`) in which every staying rank sends `value` and the ranks it
    leaves out to every other staying rank: returns each staying rank's value; a rank that leaves
    out other ranks is named."""
    stay = tuple(fabric.live)
    call = CallId(generation, generation, MASK_LANE)
    flags = [int(r not in stay) for r in range(fabric.num_ranks)]
    mine = torch.tensor([value, *flags], dtype=torch.int64, device="cpu")
    for p in stay:
        if p != fabric.rank:
            out = fabric.outbox(MASK_LANE, p, call, mine.numel(), 0)
            out.header.copy_(mine)
            fabric.send(out)
    values = {fabric.rank: value}
    for msg in fabric.arrivals(MASK_LANE, call, stay, phase):
        said = _mask_message(fabric, msg, mine.numel())
        if said != {r for r in range(fabric.num_ranks) if flags[r]}:
            raise PeerDataError(
                f"{phase}: rank {msg.peer} masks rank(s) {sorted(said)}, this rank "
                f"{sorted(r for r in range(fabric.num_ranks) if flags[r])}"
            )
        values[msg.peer] = int(msg.header[0])
        fabric.release(MASK_LANE, msg.peer, call)
    return values


def failed_peers(error: Exception) -> frozenset[int]:
    """The ranks `error` says failed a call over the fabric: dead or silent past the deadline (not
    where only a connection broke and which peer left is unknown), or the culprit of a peer's abort
    notice (a notice does not say why: a rank blamed for bad data counts too)."""
    if isinstance(error, CommTimeoutError):
        if error.dead_peers:
            return frozenset(error.dead_peers)
        return frozenset() if error.lost else frozenset(error.peers)
    if isinstance(error, PeerAbortedError) and error.culprit is not None:
        return frozenset({error.culprit})
    return frozenset()


def agree_on_union(
    fabric: Fabric, gone: frozenset[int], seq: int, generation: int
) -> tuple[tuple[int, ...], frozenset[int], int]:
    """Mask rounds until every staying rank leaves out the same ranks: in each, every rank sends the
    ranks it leaves out and the call it failed to every rank it keeps, and takes in what they send.
    A round in which all it heard equals its own set is the last, for every rank alike (each sends
    one set a round to all it keeps). Returns (the staying ranks, the call each of them failed, the
    generation of the last round)."""
    while True:
        generation += 1
        stay = tuple(p for p in range(fabric.num_ranks) if p not in gone)
        call = CallId(generation, generation, MASK_LANE)
        mine = torch.tensor(
            [seq, *(int(r in gone) for r in range(fabric.num_ranks))], dtype=torch.int64, device="cpu"
        )
        for p in stay:
            if p != fabric.rank:
                out = fabric.outbox(MASK_LANE, p, call, mine.numel(), 0)
                out.header.copy_(mine)
                fabric.send(out)
        union, seqs, same = set(gone), {seq}, True
        try:
            for msg in fabric.arrivals(MASK_LANE, call, stay, f"agreeing to mask rank(s) {sorted(gone)}"):
                said = _mask_message(fabric, msg, mine.numel())
                fabric.release(MASK_LANE, msg.peer, call)
                union, same = union | said, same and said == gone
                seqs.add(int(msg.header[0]))
        except CommTimeoutError as late:  # a rank died (or fell silent) while the others agreed
            if not (died := failed_peers(late)):
                raise
            union, same = union | died, False
        if same:
            return stay, frozenset(seqs), generation
        gone = frozenset(union)


def _mask_message(fabric: Fabric, msg: Message, words: int) -> set[int]:
    """The ranks a peer's mask-round message leaves out, checked; MaskedOutError when they include
    this rank (the others masked it)."""
    theirs = msg.header
    if theirs.numel() != words or not bool(((theirs[1:] == 0) | (theirs[1:] == 1)).all()):
        raise PeerDataError(f"mask: rank {msg.peer} sent {theirs.numel()} words", culprit=msg.peer)
    if theirs[1 + fabric.rank]:
        raise MaskedOutError(
            f"rank {msg.peer} and the others masked rank {fabric.rank} out of the group (they saw it die "
            "or go silent); it takes part in no further call"
        )
    return {r for r in range(fabric.num_ranks) if theirs[1 + r]}


def abort_notice(culprit: int, kind: int, rejected: int, seq: int) -> AbortNotice:
    """What a peer's abort notice says (culprit -1: the peer gave up on its own; `kind` a code of
    `ubep.calls.KINDS`)."""
    method = METHODS.get(kind, kind)
    if rejected:
        reason = f"it rejected its input for {method} (call #{seq}); see its error"
    elif culprit < 0:
        reason = f"it gave up on its {method} (call #{seq})"
    else:
        reason = f"it gave up on its {method} (call #{seq}) because rank {culprit} failed"
    return AbortNotice(reason, None if culprit < 0 else culprit)


def is_this_call(
    phase: str, call: CallId, peer: int, seq: int, kind: int, notice: Callable[[int], AbortNotice | None]
) -> bool:
    """Whether `peer`'s landed message, framed (seq, kind), is of `call`: False for an older call's (one
    this rank gave up on: the engine drops it); raises PeerAbortedError when the peer is ahead because it
    gave up on `call` (`notice(peer)`), and PeerDataError when the peer is in another call."""
    if seq < call.seq:
        return False
    if seq > call.seq and (said := notice(peer)) is not None:
        raise PeerAbortedError(phase, peer, said)  # it gave up on this call and went on
    if seq != call.seq or kind != KINDS[call.kind]:
        raise PeerDataError(
            f"{phase}: rank {peer} sent a message of call #{seq} ({METHODS.get(kind, f'kind {kind}')}), this "
            f"rank is in call #{call.seq} ({METHODS[KINDS[call.kind]]}): the ranks' calls are out of step"
        )
    return True


def notice_key(peer: int, seq: int, kind: int) -> tuple[int, int, bool]:
    """How an engine files and finds a peer's abort notice: by the call's seq, and whether it is a mask
    round (whose seq is its generation, which a call's seq may equal). Not by the call's kind: a peer
    that gave up on its combine #5 while this rank waits in a dispatch #5 (one of them skipped a call)
    has left this rank's call too, and saying so beats waiting for the deadline."""
    return peer, seq, kind == KINDS["mask"]

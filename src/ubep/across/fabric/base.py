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
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from ubep.calls import KINDS, METHODS, CallId
from ubep.errors import PeerDataError
from ubep.waiting import AbortNotice, PeerAbortedError

MASK_LANE = "mask"  # every engine's own lane: the rounds of `mask_ranks`


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


class Fabric(Protocol):
    """One rank's end of the fabric: its inboxes, its puts, its waits."""

    name: str
    rank: int
    num_ranks: int
    live: tuple[int, ...]  # the ranks taking part, ascending (all of them until some are masked)

    def outbox(self, lane: str, peer: int, call: CallId, words: int, nbytes: int) -> Outgoing:
        """This rank's message of `call` on `lane` to `peer`, to fill: `words` header words, `nbytes`
        payload bytes (the lane's limits at most). Its memory is the engine's (registered)."""

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

    def release(self, lane: str, peer: int, call: CallId) -> None:
        """This rank is done with `peer`'s message of `call` on `lane`: its inbox may take a later one."""

    def begin(self, call: CallId) -> None:
        """This rank begins `call` (before its first message of it): inboxes still holding an older
        call's message, one this rank gave up on, are freed for the peers' later messages."""

    def abort(self, call: CallId, culprit: int | None = None, rejected: bool = False) -> None:
        """Tell every peer that this rank gives up on `call`, blaming `culprit` (None: itself;
        `rejected`: it rejected its own input for the call, before sending anything)."""

    def mask(self, ranks: Iterable[int], seq: int) -> int:
        """Collective among the ranks that stay (over the fabric): leave `ranks` out of every later
        wait. `seq` is the last call this rank started; returns the largest any staying rank started,
        after which they all continue (as `ubep.transport.base.Transport.mask`)."""

    def close(self) -> None:
        """Release every inbox and connection; idempotent."""


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
        if not torch.equal(theirs[1:], mine[1:]):
            masked = [r for r in range(fabric.num_ranks) if theirs[1 + r]]
            said = f"masks ranks {masked}, this rank {sorted(gone)}"
            raise PeerDataError(f"mask_ranks: rank {msg.peer} {said}")
        latest = max(latest, int(theirs[0]))
        fabric.release(MASK_LANE, msg.peer, call)
    return stay, latest


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

"""The gloo fabric: messages as torch.distributed point-to-point sends over TCP (no new dependency).

    protocol -> [GlooFabric: isend / pre-posted irecv per (lane, peer, half)] -> gloo -> TCP

gloo sends a message only once its receiver has posted a receive for it (the
receiver tells the sender), so every inbox is posted in advance: both halves of
every lane at construction, each again as soon as this rank frees it (released,
or dropped: an abandoned call's message, or a bad one). A sender never waits for
its receiver to reach the call. A receive may be larger than the message, so an
inbox is posted at the lane's largest size and the message's frame says how much
of it landed.

Data as flag. gloo's receive completes only when the receiver waits on it, and a
wait with a timeout closes the connection, so a receiver never waits on one that
has not landed: it watches the inbox itself. gloo writes a message into it in
order, so the frame's last word (the call's seq, zeroed before the inbox is
posted) says the frame is there, and a trailer after the payload (a word derived
from the seq and kind, which stale bytes match with odds of 2^-64) says the
whole message is; then the wait returns at once. A frame whose trailer is still
missing after `TRAILER_GRACE_S` has its receive waited on (its message is
landing: the wait ends when it has); a trailer that does not match then names
the sender, as does a frame outside its lane's bounds, and the inbox is posted
again either way.

Every send is accounted for. gloo's send has no completion to poll, and a wait
on one whose receiver never posts times out and closes the connection. So the
receiver says what it freed: every frame carries, for each of the receiver's
inboxes of the sender's messages, the latest call whose message it freed there,
and how many of the sender's abort notices it has taken. A sender waits only on
sends those words say have landed (the wait returns at once), and keeps the rest.
Abort notices (culprit, kind, seq) land on one more receive per peer, taken
whenever this rank drives the fabric, and posted again at once.

Frame (int64 words, before the protocol's header): header words, payload bytes,
kind, the acknowledgements (per lane and half, then notices), seq. The fabric has
a group of its own (so its tags meet no collective of the Buffer's group), under a
name only its members know (`own_group`).

What it can tell of failures: a peer on this host that died is named at once
(its process is gone); a peer whose connection closed (it left, or died
elsewhere) once a gloo call on that connection fails; any other silent peer, stopped or dead, at
the deadline (a receive that never lands cannot be told from one that is late).
gloo's own errors never reach the caller: a call on a connection that failed
marks its peer lost, and the wait names it. Nothing here busy-polls: a wait
yields, then sleeps (`ubep.waiting.Waiter`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ubep.across.fabric.base import Fabric, Frame, Lane, Outgoing, Slot, check_fits, notice_key
from ubep.calls import KINDS, CallId
from ubep.deadlines import PeerPids, collective_deadline, construction_s
from ubep.registry import GLOO
from ubep.waiting import AbortNotice

HEAD = 3  # the frame's first int64 words: header words, payload bytes, kind
WORDS, NBYTES, KIND = range(HEAD)
NOTICE = 3  # an abort notice: culprit + 1 (0: the sender itself), 2 kind + rejected, seq (last: landed)
CONTROL_TAG = 1  # lane i, half h: tag 2 + 2 i + h
TRAILER_GRACE_S = 0.05  # how long a landed frame waits for its trailer before its receive is waited on


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


def _trailer(seq: int, kind: int) -> int:
    """The word after a message's payload: a 64-bit mix of its seq and kind, as int64."""
    mixed = (seq * 0x9E3779B97F4A7C15 + kind * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) % (1 << 64)
    return mixed - (1 << 64) if mixed >= 1 << 63 else mixed


@dataclass(slots=True)
class _Inbox:
    """One posted receive: its buffer and the work that completes when a message lands in it."""

    buffer: torch.Tensor  # uint8 [frame + header + payload + trailer], the lane's largest
    work: object | None = None  # None: not posted (its peer's connection is lost)
    waited: bool = False  # its receive was waited on (a second wait would wait for another message)
    intact: bool = False  # once waited: its trailer matched its frame
    seen: float | None = None  # when its frame was first seen without its trailer


@dataclass(frozen=True, slots=True)
class _Sent:
    """A send kept until the receiver says it landed: `ack` indexes the receiver's acknowledgements (an
    inbox of this rank's messages, or the notices), `number` is what they must reach (a call's seq, or
    the notice's count)."""

    ack: int
    number: int
    buffer: torch.Tensor
    work: object


def own_group(
    group: dist.ProcessGroup | None, rank: int, num_ranks: int, timeout_s: float
) -> dist.ProcessGroupGloo:
    """Collective over `group`: a gloo group of the same ranks with connections of its own, made within
    `timeout_s`.

    Not `dist.new_group`: that needs every rank of the world to create every group in the same
    order, which a Buffer on a subgroup cannot ask of the ranks outside it. Two subgroups building
    at once then took the same name, and so read each other's addresses in the store (one of them
    timed out connecting). Here rank 0 of `group` draws a name that only its members learn."""
    name = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(name, group=group, group_src=0)
    root = dist.distributed_c10d._get_process_group_store(group if group is not None else dist.group.WORLD)
    store = dist.PrefixStore(f"ubep-fabric/{name[0]}/", root)
    return dist.ProcessGroupGloo(store, rank, num_ranks, timedelta(seconds=timeout_s))


class GlooFabric(Fabric):
    """One rank's end of the fabric over a gloo group of its own. Collective to build."""

    name = GLOO.name

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        rank: int,
        num_ranks: int,
        lanes: Sequence[Lane],
        timeout_s: float,
    ):
        super().__init__(rank, num_ranks, lanes, timeout_s)
        with collective_deadline(group, construction_s(timeout_s), "Buffer construction (fabric)"):
            self._pids = PeerPids.gather(group, rank, num_ranks)
            self.group = own_group(group, rank, num_ranks, construction_s(timeout_s))
        self.group._set_default_timeout(timedelta(seconds=timeout_s))  # a call's waits, from here on
        # The frame's last word, its seq: the acknowledgements (per lane and half, then notices) before it.
        self._seq_at = HEAD + 2 * len(self._lanes) + 1
        self._inbox = {
            (i, p, h): _Inbox(torch.empty(self._inbox_bytes(lane), dtype=torch.uint8, device="cpu"))
            for i, lane in enumerate(self._lanes)
            for p in self.peers
            if lane.peers is None or p in lane.peers
            for h in (0, 1)
        }
        # What this rank tells each peer it freed: per lane and half, the latest call whose message from
        # the peer it freed there; then how many of the peer's notices it took.
        self._freed = {
            p: torch.zeros(self._seq_at - HEAD, dtype=torch.int64, device="cpu") for p in self.peers
        }
        self._in_flight: dict[int, list[_Sent]] = {p: [] for p in self.peers}
        self._notices_sent = dict.fromkeys(self.peers, 0)
        self._control = {p: _Inbox(torch.zeros(NOTICE, dtype=torch.int64, device="cpu")) for p in self.peers}
        self._lost: set[int] = set()  # peers whose connection failed
        self._closed = False
        for slot in self._inbox:
            self._post(slot)
        for p in self.peers:
            self._post_control(p)

    def _inbox_bytes(self, lane: Lane) -> int:
        """An inbox: frame, header, payload (8-byte aligned), trailer."""
        return 8 * (self._seq_at + 1 + lane.words + 1) + _aligned(lane.nbytes)

    def _guarded(self, peer: int, op: Callable[[], object]) -> object | None:
        """`op()`, a gloo call on `peer`'s connection; one that fails marks the peer lost (None): a wait
        names it, in ubep's words."""
        if peer in self._lost:
            return None
        try:
            return op()
        except RuntimeError:  # gloo's own error (torch's DistError is one): the connection failed
            self._lost.add(peer)
            return None

    # -- receiving --------------------------------------------------------------------------------

    def _post(self, slot: Slot) -> None:
        lane, peer, half = slot
        box = self._inbox[slot]
        box.buffer[8 * self._seq_at : 8 * (self._seq_at + 1)].zero_()  # no message yet (a seq is never 0)
        box.waited, box.intact, box.seen = False, False, None
        tag = 2 + 2 * lane + half
        box.work = self._guarded(peer, lambda: self.group.recv([box.buffer], peer, tag))

    def _post_control(self, peer: int) -> None:
        box = self._control[peer]
        box.buffer.zero_()
        box.work = self._guarded(peer, lambda: self.group.recv([box.buffer], peer, CONTROL_TAG))

    def _landed_frame(self, slot: Slot) -> Frame | None:
        """The inbox's frame once all of its message has landed (its receive then completed): the
        frame's seq is there, and the trailer after the length it says, or its receive was waited on
        (a frame out of the lane's bounds at once: there is no length to look after)."""
        box = self._inbox[slot]
        if box.work is None:
            return None
        frame = box.buffer[: 8 * (self._seq_at + 1)].view(torch.int64)
        seq = int(frame[self._seq_at])
        if seq == 0:
            return None
        landed = (seq, int(frame[KIND]), int(frame[WORDS]), int(frame[NBYTES]))
        if box.waited or not self._in_bounds(slot, landed):
            return landed
        if not self._whole(box, landed):
            now = time.monotonic()
            box.seen = box.seen or now
            if now - box.seen < TRAILER_GRACE_S:
                return None  # the frame is here, the rest is still landing
        if not self._complete(slot):
            return None
        box.intact = self._whole(box, landed)
        if box.intact:
            self._retire(slot[1], frame[HEAD : self._seq_at].tolist())
        return landed

    def _whole(self, box: _Inbox, frame: Frame) -> bool:
        """Whether the trailer after the message the frame announces is there."""
        seq, kind, words, nbytes = frame
        at = 8 * (self._seq_at + 1 + words) + _aligned(nbytes)
        return int(box.buffer[at : at + 8].view(torch.int64)[0]) == _trailer(seq, kind)

    def _complete(self, slot: Slot) -> bool:
        """Wait on the inbox's receive, whose message has begun to land (at once where all of it has);
        False: the connection failed meanwhile."""
        box = self._inbox[slot]
        box.waited = self._guarded(slot[1], box.work.wait) is not None
        return box.waited

    def _intact(self, slot: Slot) -> bool:
        return self._inbox[slot].intact

    def _contents(self, slot: Slot, words: int, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        buffer, at = self._inbox[slot].buffer, 8 * (self._seq_at + 1 + words)
        return buffer[8 * (self._seq_at + 1) : at].view(torch.int64), buffer[at : at + nbytes]

    def _drop(self, slot: Slot) -> None:
        """Free the inbox: all of its message in first (its receive completed), then posted again; the
        sender learns it from this rank's next frame."""
        lane, peer, half = slot
        box = self._inbox[slot]
        if box.work is not None and not box.waited:
            self._complete(slot)
        seq = int(box.buffer[: 8 * (self._seq_at + 1)].view(torch.int64)[self._seq_at])
        freed = self._freed[peer]
        freed[2 * lane + half] = max(int(freed[2 * lane + half]), seq)
        self._post(slot)

    def _occupied(self) -> list[Slot]:
        return list(self._inbox)

    def _gone(self, peer: int) -> bool:
        return peer in self._pids.dead()

    def _lost_peers(self, pending: list[int]) -> tuple[list[int], list[int]]:
        lost = [p for p in pending if p in self._lost]
        return lost, [p for p in self._pids.dead_after_grace() if p in lost] if lost else []

    def _progress(self) -> None:
        """Take every abort notice that landed (each control receive is posted again at once)."""
        for p in self.peers:
            self._take_notices(p)

    def _take_notices(self, peer: int) -> None:
        box = self._control[peer]
        while box.work is not None and int(box.buffer[NOTICE - 1]) != 0:  # seq, last: it landed
            if self._guarded(peer, box.work.wait) is None:
                return
            self._take_abort(peer, *box.buffer.tolist())
            self._freed[peer][-1] += 1
            self._post_control(peer)

    def _notice_of(self, call: CallId) -> Callable[[int], AbortNotice | None]:
        """A notice `peer` sent about this call (seen on its control receive)."""

        def notice(peer: int) -> AbortNotice | None:
            self._take_notices(peer)
            return self._notices.get(notice_key(peer, call.seq, KINDS[call.kind]))

        return notice

    def release(self, lane: str, peer: int, call: CallId) -> None:
        self._drop((self.lanes[lane], peer, call.seq % 2))

    # -- sending ----------------------------------------------------------------------------------

    def outbox(self, lane: str, peer: int, call: CallId, words: int, nbytes: int) -> Outgoing:
        """A message to fill for `peer`, in a buffer of its own (kept until the peer says it landed)."""
        i, first = self.lanes[lane], 8 * (self._seq_at + 1)
        check_fits(self._lanes[i], peer, call, words, nbytes)
        at, end = first + 8 * words, first + 8 * words + _aligned(nbytes)
        buffer = torch.empty(end + 8, dtype=torch.uint8, device="cpu")
        frame = buffer[:first].view(torch.int64)
        frame[self._seq_at], frame[KIND], frame[WORDS], frame[NBYTES] = (
            call.seq,
            KINDS[call.kind],
            words,
            nbytes,
        )
        buffer[end : end + 8].view(torch.int64)[0] = _trailer(call.seq, KINDS[call.kind])
        key = (i, peer, call.seq)
        return Outgoing(buffer[first:at].view(torch.int64), buffer[at : at + nbytes], (key, buffer))

    def send(self, out: Outgoing) -> None:
        """Send a filled message, with what this rank freed of the peer's messages; returns at once. Its
        buffer and work are kept until the peer says it landed (`_retire`). Nothing goes to a lost peer."""
        (lane, peer, seq), buffer = out.key
        buffer[8 * HEAD : 8 * self._seq_at].view(torch.int64).copy_(self._freed[peer])
        tag = 2 + 2 * lane + seq % 2
        work = self._guarded(peer, lambda: self.group.send([buffer], peer, tag))
        if work is not None:
            self._in_flight[peer].append(_Sent(2 * lane + seq % 2, seq, buffer, work))

    def _retire(self, peer: int, freed: list[int]) -> None:
        """`peer` freed this rank's messages up to `freed` (its acknowledgements, as `_freed`): those
        sends have landed, and are waited on (at once); the rest are kept."""
        keep = []
        for sent in self._in_flight[peer]:
            landed = sent.number < freed[-1] if sent.ack == len(freed) - 1 else sent.number <= freed[sent.ack]
            if not landed:
                keep.append(sent)
            elif self._guarded(peer, sent.work.wait) is None:
                return  # the connection failed: nothing more to wait on
        self._in_flight[peer] = keep

    def _tell_abort(self, culprit: int, how: int, seq: int) -> None:
        notice = torch.tensor([culprit, how, seq], dtype=torch.int64, device="cpu")
        for p in self.peers:
            work = self._guarded(p, lambda p=p: self.group.send([notice], p, CONTROL_TAG))
            if work is not None:
                self._in_flight[p].append(_Sent(len(self._freed[p]) - 1, self._notices_sent[p], notice, work))
                self._notices_sent[p] += 1

    def close(self) -> None:
        """Wait for the sends still in flight (`_flush`), then shut the group down; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._flush(time.monotonic() + self.timeout_s)
        self.group.shutdown()

    def _flush(self, deadline: float) -> None:
        """Wait, until `deadline` (monotonic seconds), for this rank's sends still in flight to the
        staying peers. A send leaves only once its receiver has posted the inbox again (it freed the
        message before it there), so this rank's last messages may still wait for their turn: a
        shutdown before they leave would lose them, and the peer would name this rank as lost. A
        peer lost, dead or masked is not waited on; a send still waiting at the deadline is given up
        with the connection (its peer names this rank at its own deadline)."""
        gone = self._pids.dead()
        for peer, sends in self._in_flight.items():
            if peer in self._lost or peer in gone or peer not in self.live:
                continue
            for sent in sends:
                left_s = deadline - time.monotonic()
                if left_s < 0.001:  # (a wait of 0 ms would mean gloo's default timeout)
                    break
                wait = timedelta(seconds=left_s)
                if self._guarded(peer, lambda sent=sent, wait=wait: sent.work.wait(wait)) is None:
                    break  # the connection failed, or the deadline passed: nothing more to wait on
        self._in_flight = {p: [] for p in self.peers}

"""The gloo fabric: messages as torch.distributed point-to-point sends over TCP (no new dependency).

    protocol -> [GlooFabric: isend / pre-posted irecv per (lane, peer, half)] -> gloo -> TCP

gloo sends a message only once its receiver has posted a receive for it (the
receiver tells the sender), so every inbox is posted in advance: both halves of
every lane at construction, each again as soon as this rank releases it. A
sender never waits for its receiver to reach the call. A receive may be larger
than the message, so an inbox is posted at the lane's largest size and the
message's frame says how much of it landed.

Data as flag. gloo's receive completes only when the receiver waits on it, and a
wait with a timeout closes the connection, so a receiver never waits on one that
has not landed: it watches the inbox itself. gloo writes a message into it in
order, so the frame's last word (the call's seq, zeroed before the inbox is
posted) says the frame is there, and a trailer after the payload (a word derived
from the seq and kind, which stale bytes match with odds of 2^-64) says the
whole message is; then the wait returns at once.

Frame (int64 words, before the protocol's header): header words, payload bytes,
kind, seq. The fabric has a group of its own (so its tags meet no
collective of the Buffer's group), and one more receive per peer for abort
notices (seq, culprit), polled while waiting.

What it can tell of failures: a peer on this host that died is named at once
(its process is gone); any other silent peer, stopped or dead, at the deadline
(a receive that never lands cannot be told from one that is late). Nothing here
busy-polls: a wait yields, then sleeps (`ubep.waiting.Waiter`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ubep.across.fabric.base import Fabric, Frame, Lane, Outgoing, Slot, abort_notice, notice_key
from ubep.calls import KINDS, CallId
from ubep.deadlines import PeerPids, collective_deadline
from ubep.waiting import AbortNotice

FRAME = 4  # int64 words before the header: header words, payload bytes, kind, seq (last: it says the
WORDS, NBYTES, KIND, SEQ = range(FRAME)  # frame has landed)
NOTICE = 3  # an abort notice: culprit + 1 (0: the sender itself), 2 kind + rejected, seq (last: landed)
CONTROL_TAG = 1  # lane i, half h: tag 2 + 2 i + h
# How many calls behind a peer's latest message a send to it is surely gone: two calls of each
# low-latency kind may await their receive halves, one normal call, and margin.
RETIRE_LAG = 8


def _bytes_of(lane: Lane) -> int:
    """An inbox: frame, header, payload (8-byte aligned), trailer."""
    return 8 * (FRAME + lane.words + 1) + _aligned(lane.nbytes)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


def _trailer(seq: int, kind: int) -> int:
    """The word after a message's payload: a 64-bit mix of its seq and kind, as int64."""
    mixed = (seq * 0x9E3779B97F4A7C15 + kind * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) % (1 << 64)
    return mixed - (1 << 64) if mixed >= 1 << 63 else mixed


@dataclass(slots=True)
class _Inbox:
    """One posted receive: its buffer and the work that completes when a message lands in it."""

    buffer: torch.Tensor  # uint8 [frame + header + payload], the lane's largest
    work: object | None = None
    waited: bool = False  # its receive was waited on (a second wait would wait for another message)


class GlooFabric(Fabric):
    """One rank's end of the fabric over a gloo group of its own. Collective to build."""

    name = "gloo"

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        rank: int,
        num_ranks: int,
        lanes: Sequence[Lane],
        timeout_s: float,
    ):
        super().__init__(rank, num_ranks, lanes, timeout_s)
        ranks = list(range(num_ranks)) if group is None else dist.get_process_group_ranks(group)
        with collective_deadline(group, timeout_s, "Buffer construction (fabric)"):
            self.group = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s), backend="gloo")
            self._pids = PeerPids.gather(self.group, rank, num_ranks)
        self._global = ranks  # group rank -> global rank, for point-to-point calls
        self._inbox = {
            (i, p, h): _Inbox(torch.empty(_bytes_of(lane), dtype=torch.uint8, device="cpu"))
            for i, lane in enumerate(self._lanes)
            for p in self.peers
            if lane.peers is None or p in lane.peers
            for h in (0, 1)
        }
        self._in_flight: dict[int, list[tuple[int, torch.Tensor, object]]] = {p: [] for p in self.peers}
        self._control = {p: _Inbox(torch.zeros(NOTICE, dtype=torch.int64, device="cpu")) for p in self.peers}
        self._closed = False
        for key in self._inbox:
            self._post(key)
        for p in self.peers:
            self._post_control(p)

    # -- receiving --------------------------------------------------------------------------------

    def _post(self, slot: Slot) -> None:
        lane, peer, half = slot
        box = self._inbox[slot]
        box.buffer[8 * SEQ : 8 * (SEQ + 1)].zero_()  # no message yet (a seq is never 0)
        box.waited = False
        try:
            box.work = dist.irecv(
                box.buffer, src=self._global[peer], group=self.group, tag=2 + 2 * lane + half
            )
        except RuntimeError:  # the peer closed its end (it left): no message will come, a wait says so
            box.work, box.waited = None, True

    def _post_control(self, peer: int) -> None:
        box = self._control[peer]
        box.buffer.zero_()
        try:
            box.work = dist.irecv(box.buffer, src=self._global[peer], group=self.group, tag=CONTROL_TAG)
        except RuntimeError:  # the peer closed its end: no notice will come
            box.work = None

    def _landed_frame(self, slot: Slot) -> Frame | None:
        """The inbox's frame once all of its message has landed (its receive then completed): the
        frame's seq is there, and the trailer after the length it says (a frame out of the lane's
        bounds at once: there is no length to look after)."""
        box = self._inbox[slot]
        frame = box.buffer[: 8 * FRAME].view(torch.int64)
        seq = int(frame[SEQ])
        if seq == 0:
            return None
        words, nbytes, kind = int(frame[WORDS]), int(frame[NBYTES]), int(frame[KIND])
        if not self._in_bounds(slot, (seq, kind, words, nbytes)):
            return seq, kind, words, nbytes
        at = 8 * (FRAME + words) + _aligned(nbytes)
        if int(box.buffer[at : at + 8].view(torch.int64)[0]) != _trailer(seq, kind):
            return None  # the frame is here, the rest is still landing
        if not box.waited:
            box.work.wait()  # it has landed: returns at once
            box.waited = True
        return seq, kind, words, nbytes

    def _contents(self, slot: Slot, words: int, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        buffer, at = self._inbox[slot].buffer, 8 * (FRAME + words)
        return buffer[8 * FRAME : at].view(torch.int64), buffer[at : at + nbytes]

    def _drop(self, slot: Slot) -> None:
        self._post(slot)

    def _occupied(self) -> list[Slot]:
        return list(self._inbox)

    def _gone(self, peer: int) -> bool:
        return peer in self._pids.dead()

    def _notice_of(self, call: CallId) -> Callable[[int], AbortNotice | None]:
        """A notice `peer` sent about this call (seen on its control receive)."""

        def notice(peer: int) -> AbortNotice | None:
            box = self._control[peer]
            while box.work is not None and int(box.buffer[NOTICE - 1]) != 0:  # seq, last: it landed
                box.work.wait()
                culprit, how, seq = (int(v) for v in box.buffer)
                self._notices[notice_key(peer, seq, how // 2)] = abort_notice(
                    culprit - 1, how // 2, how % 2, seq
                )
                self._post_control(peer)
            return self._notices.get(notice_key(peer, call.seq, KINDS[call.kind]))

        return notice

    def _taken(self, peer: int, seq: int) -> None:
        self._retire(peer, seq)

    def release(self, lane: str, peer: int, call: CallId) -> None:
        self._post((self.lanes[lane], peer, call.seq % 2))

    # -- sending ----------------------------------------------------------------------------------

    def outbox(self, lane: str, peer: int, call: CallId, words: int, nbytes: int) -> Outgoing:
        """A message to fill for `peer`, in a buffer of its own (kept until the send has surely left)."""
        i = self.lanes[lane]
        at, end = 8 * (FRAME + words), 8 * (FRAME + words) + _aligned(nbytes)
        buffer = torch.empty(end + 8, dtype=torch.uint8, device="cpu")
        frame = buffer[: 8 * FRAME].view(torch.int64)
        frame[SEQ], frame[KIND], frame[WORDS], frame[NBYTES] = call.seq, KINDS[call.kind], words, nbytes
        buffer[end : end + 8].view(torch.int64)[0] = _trailer(call.seq, KINDS[call.kind])
        key = (i, peer, call.seq)
        return Outgoing(buffer[8 * FRAME : at].view(torch.int64), buffer[at : at + nbytes], (key, buffer))

    def send(self, out: Outgoing) -> None:
        """Send a filled message; returns at once. Its buffer and work stay referenced until the send has
        surely left (`_retire`): gloo's send has no completion to poll, and a wait on one whose receiver
        has not posted would time out and close the connection."""
        (lane, peer, seq), buffer = out.key
        work = dist.isend(buffer, dst=self._global[peer], group=self.group, tag=2 + 2 * lane + seq % 2)
        self._in_flight[peer].append((seq, buffer, work))

    def _retire(self, peer: int, seq: int) -> None:
        """`peer` sent a message of call `seq`, so it has received (or given up on) this rank's messages
        of calls far enough behind: at most two low-latency calls of a kind await a receive half, and
        calls a rank gave up on are posted again at its next call (`begin`). Those sends have left."""
        keep = []
        for sent in self._in_flight[peer]:
            if sent[0] <= seq - RETIRE_LAG:
                sent[2].wait()  # it has left: returns at once
            else:
                keep.append(sent)
        self._in_flight[peer] = keep

    def _tell_abort(self, culprit: int, how: int, seq: int) -> None:
        notice = torch.tensor([culprit, how, seq], dtype=torch.int64, device="cpu")
        for p in self.peers:
            try:
                work = dist.isend(notice, dst=self._global[p], group=self.group, tag=CONTROL_TAG)
            except RuntimeError:
                continue  # a peer already gone: it needs no notice
            self._in_flight[p].append((seq, notice, work))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        dist.destroy_process_group(self.group)

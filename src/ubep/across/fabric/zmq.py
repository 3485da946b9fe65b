"""The zmq fabric: messages over ZeroMQ, every wait blocked on all peers at once (pyzmq).

    protocol -> [ZmqFabric: a DEALER to each peer's ROUTER; waits in zmq_poll] -> ZeroMQ -> TCP

Sockets. Each rank binds one ROUTER (every peer's messages land there) and
connects one DEALER to each peer's ROUTER, named by its rank. The addresses
travel once, at construction, over the Buffer's group (within construction's deadline);
construction ends once every DEALER's connection is up and every peer said so
(READY): a rank whose own connections came up first cannot close and exit
while a slower peer still waits for its connection to that rank (or its peer named).
ZeroMQ's I/O thread moves the bytes: a send queues its message and returns (no
high-water mark: never dropped, never blocking), and a receive finds a message
whole or not at all.

Waiting. A wait blocks in zmq_poll on the ROUTER and on every DEALER's monitor:
it sleeps until a peer's message lands, a connection drops or the liveness tick
comes (`ubep.waiting.Waiter`, with no yields first). Nothing polls, and other
lanes are looked at only where a message of theirs has landed.

Messages. One ZeroMQ message each: the frame (int64: lane, seq, kind, header
words, payload bytes), the header words, the payload bytes. A message is taken
off the socket copy-free (ZeroMQ's buffer becomes the inbox) and its frame read
once, through a view made there; the base then checks it against its lane. A
message whose slot (lane, peer, seq parity) still holds an earlier one waits
behind it. Sends are copy-free as well: pyzmq holds each outbox until
ZeroMQ has sent it, and an outbox is never reused. A call returns only once
its messages have left for their sockets (`sent`): ZeroMQ's I/O thread sends
them, and a process killed before that thread ran (a starved one, under load)
would take them with it, failing a call it had completed on the peers that
waited for them.

Failures. A peer that closes its Buffer says so last (BYE, behind all of its
messages on the same connection): it is lost once its BYE is taken. A peer
whose process exited on this host is named at once; one whose connection
dropped without a BYE (it died elsewhere) LOST_GRACE_S after its DEALER's
monitor says so (what it sent before travels on another connection, which
ZeroMQ keeps no order with); a stopped or silent one at the deadline. An abort
notice is a message on lane ABORT. ZeroMQ's errors never reach the caller: a
send that fails marks its peer lost, and the wait names it.
"""

from __future__ import annotations

import math
import os
import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import zmq
from zmq.utils.monitor import recv_monitor_message

from ubep.across.fabric.base import Fabric, Frame, Lane, Outgoing, Slot, check_fits, notice_key
from ubep.calls import KINDS, CallId
from ubep.deadlines import PeerPids, collective_deadline, construction_s
from ubep.registry import ZMQ
from ubep.waiting import AbortNotice, Waiter

# A message's frame: lane, seq, kind, header words, payload bytes; an abort's: ABORT, seq, how, culprit.
FRAME = struct.Struct("<qqqqq")
ABORT = -1  # the frame's lane of an abort notice
BYE = -2  # the frame's lane of the last message of a peer that closes its Buffer
READY = -3  # the frame's lane of a peer's first message: all of its connections are up
LOST_GRACE_S = 0.2  # a dropped connection without a BYE: how long its peer's last messages may take
SENT_POLL_S = 0.05  # how often `sent` looks whether a peer it waits to send to is gone
CLOSE_LINGER_S = 2.0  # how long close() lets queued messages reach their peers
UP_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED  # a DEALER's connection is up (ZMTP handshake done)
DOWN_EVENTS = zmq.EVENT_DISCONNECTED  # and dropped: its peer's ROUTER closed (it exited or closed)


def reachable_address(rendezvous: str | None = None) -> str:
    """This host's address as its peers reach it: the one it routes from toward the rendezvous host
    (torch.distributed's MASTER_ADDR, as torchrun sets it), else its hostname's."""
    rendezvous = rendezvous or os.environ.get("MASTER_ADDR")
    if not rendezvous:
        return socket.gethostbyname(socket.gethostname())
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((rendezvous, 9))  # a datagram socket's connect sends nothing: it picks the route
        return probe.getsockname()[0]


@dataclass(frozen=True, slots=True)
class _Landed:
    """A message as it came off the socket: its frame, read once, and its bytes (ZeroMQ's buffer)."""

    frame: Frame
    data: torch.Tensor  # uint8 [FRAME + 8 words + nbytes], a view of `zmq.Frame` kept alive by `body`
    body: object  # the zmq.Frame that owns the bytes


@dataclass(frozen=True, slots=True)
class _Send:
    """A message being written: where it goes, and its one buffer (frame, header, payload)."""

    lane: int
    peer: int
    seq: int
    buffer: torch.Tensor  # uint8


class ZmqFabric(Fabric):
    """One rank's end of the fabric: a ZeroMQ context of its own. Collective to build."""

    name = ZMQ.name

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        rank: int,
        num_ranks: int,
        lanes: Sequence[Lane],
        timeout_s: float,
    ):
        super().__init__(rank, num_ranks, lanes, timeout_s)
        self._slots = {
            (i, p, h)
            for i, lane in enumerate(self._lanes)
            for p in self.peers
            if lane.peers is None or p in lane.peers
            for h in (0, 1)
        }
        self._landed: dict[Slot, deque[_Landed]] = {}  # slots holding messages, oldest first
        self._lost: set[int] = set()  # peers that closed (their BYE came), or a send to them failed
        self._up: set[int] = set()  # peers whose connection came up
        self._ready: set[int] = set()  # peers whose connections all came up (their READY came)
        self._down: dict[int, float] = {}  # peers whose connection dropped without a BYE: since when
        self._unsent: list[tuple[int, zmq.MessageTracker]] = []  # (peer, tracker) of messages queued
        self._closed = False
        self._context = zmq.Context()
        try:
            self._router = self._context.socket(zmq.ROUTER)
            self._router.bind(f"tcp://{reachable_address()}:*")
            self._connect(group, timeout_s)
        except BaseException:  # a failed construction leaves no socket nor I/O thread behind
            self._context.destroy(linger=0)
            raise

    # -- construction -----------------------------------------------------------------------------

    def _connect(self, group: dist.ProcessGroup | None, timeout_s: float) -> None:
        """Exchange every ROUTER's address over a gloo group made for it; connect a DEALER (and its
        monitor) to each peer's; wait until every connection is up."""
        endpoints: list[str | None] = [None] * self.num_ranks
        mine = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        with collective_deadline(group, construction_s(timeout_s), "Buffer construction (fabric)"):
            self._pids = PeerPids.gather(group, self.rank, self.num_ranks)
            dist.all_gather_object(endpoints, mine, group=group)
        self._rank_of = {_identity(p): p for p in self.peers}
        self._dealers: dict[int, zmq.Socket] = {}
        self._monitors: dict[zmq.Socket, int] = {}
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        for p in self.peers:
            dealer = self._context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.ROUTING_ID, _identity(self.rank))
            dealer.setsockopt(zmq.SNDHWM, 0)  # no limit: a send never blocks, nor drops
            dealer.setsockopt(zmq.LINGER, int(1000 * min(CLOSE_LINGER_S, timeout_s)))
            dealer.copy_threshold = 0  # every send copy-free, so its tracker says when it left (`sent`)
            monitor = dealer.get_monitor_socket(UP_EVENTS | DOWN_EVENTS)
            dealer.connect(endpoints[p])
            self._dealers[p], self._monitors[monitor] = dealer, p
            self._poller.register(monitor, zmq.POLLIN)
        phase, deadline_s = "Buffer construction (fabric: connections)", construction_s(timeout_s)
        waiter = Waiter(phase, deadline_s, self._gone, lambda p: None, block=self._block, yields=0)
        while pending := [p for p in self.peers if p not in self._up]:
            self._pause(waiter, pending)
        for p in self.peers:
            self._put(p, FRAME.pack(READY, 0, 0, 0, 0))
        self._progress()
        while pending := [p for p in self.peers if p not in self._ready]:
            self._pause(waiter, pending)
            self._progress()

    # -- waiting ----------------------------------------------------------------------------------

    def _waiter(self, phase: str, notice: Callable[[int], AbortNotice | None]) -> Waiter:
        """A wait that blocks in zmq_poll from its first pause (no yields: a wake-up is a message)."""
        return Waiter(phase, self.timeout_s, self._gone, notice, block=self._block, yields=0)

    def _block(self, timeout_s: float) -> None:
        """Sleep until a message lands or a connection changes, at most `timeout_s`."""
        for sock, _ in self._poller.poll(max(0, math.ceil(1000 * timeout_s))):
            if sock is not self._router:
                self._take_events(sock)

    def _take_events(self, monitor: zmq.Socket) -> None:
        """A DEALER's connection events: up, or dropped (its peer is lost)."""
        peer = self._monitors[monitor]
        while monitor.poll(0):
            event = recv_monitor_message(monitor)["event"]
            if event & UP_EVENTS:
                self._up.add(peer)
                self._down.pop(peer, None)
            elif event & DOWN_EVENTS and peer in self._up:
                self._down.setdefault(peer, time.monotonic())

    def _is_lost(self, peer: int) -> bool:
        """Whether `peer` closed, a send to it failed, or its connection dropped LOST_GRACE_S ago."""
        down = self._down.get(peer)
        return peer in self._lost or (down is not None and time.monotonic() - down >= LOST_GRACE_S)

    def _gone(self, peer: int) -> bool:
        return self._is_lost(peer) or peer in self._pids.dead()

    def _lost_peers(self, pending: list[int]) -> tuple[list[int], list[int]]:
        lost = [p for p in pending if self._is_lost(p)]
        return lost, [p for p in self._pids.dead_after_grace() if p in lost] if lost else []

    # -- receiving --------------------------------------------------------------------------------

    def _progress(self) -> None:
        """Take every message waiting on the ROUTER (whole messages only: ZeroMQ delivers them so)."""
        router = self._router
        while router.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            parts = router.recv_multipart(copy=False)
            if (peer := self._rank_of.get(parts[0].bytes)) is not None:
                self._take(peer, parts[1:])

    def _take(self, peer: int, parts: list) -> None:
        """File `peer`'s message in its slot (behind any it still holds), or its abort notice."""
        if len(parts) != 1 or len(parts[0]) < FRAME.size:
            sizes = [len(part) for part in parts]
            self._bad[peer] = f"sent a message this rank cannot read (parts of {sizes} bytes)"
            return
        body = parts[0]
        data = torch.frombuffer(body.buffer, dtype=torch.uint8)
        lane, seq, kind, words, nbytes = data[: FRAME.size].view(torch.int64).tolist()
        if lane == ABORT:
            self._take_abort(peer, words, kind, seq)
        elif lane == BYE:
            self._lost.add(peer)
        elif lane == READY:
            self._ready.add(peer)
        elif (slot := (lane, peer, seq % 2)) in self._slots:
            self._landed.setdefault(slot, deque()).append(_Landed((seq, kind, words, nbytes), data, body))
        else:
            self._bad[peer] = f"sent a message on lane {lane}, which it has no inbox of at this rank"

    def _landed_frame(self, slot: Slot) -> Frame | None:
        held = self._landed.get(slot)
        return held[0].frame if held else None

    def _contents(self, slot: Slot, words: int, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        data, at = self._landed[slot][0].data, FRAME.size + 8 * words
        return data[FRAME.size : at].view(torch.int64), data[at : at + nbytes]

    def _intact(self, slot: Slot) -> bool:
        """Whether the message is as long as its frame says."""
        landed = self._landed[slot][0]
        _, _, words, nbytes = landed.frame
        return landed.data.numel() == FRAME.size + 8 * words + nbytes

    def _drop(self, slot: Slot) -> None:
        held = self._landed[slot]
        held.popleft()
        if not held:
            del self._landed[slot]

    def _occupied(self) -> list[Slot]:
        return list(self._landed)

    def _notice_of(self, call: CallId) -> Callable[[int], AbortNotice | None]:
        """A notice `peer` sent about this call (taken with the messages)."""

        def notice(peer: int) -> AbortNotice | None:
            self._progress()
            return self._notices.get(notice_key(peer, call.seq, KINDS[call.kind]))

        return notice

    def release(self, lane: str, peer: int, call: CallId) -> None:
        self._drop((self.lanes[lane], peer, call.seq % 2))

    # -- sending ----------------------------------------------------------------------------------

    def outbox(self, lane: str, peer: int, call: CallId, words: int, nbytes: int) -> Outgoing:
        """A message to fill for `peer`, in a buffer of its own, framed already."""
        i = self.lanes[lane]
        check_fits(self._lanes[i], peer, call, words, nbytes)
        at = FRAME.size + 8 * words
        buffer = torch.empty(at + nbytes, dtype=torch.uint8, device="cpu")
        frame = (i, call.seq, KINDS[call.kind], words, nbytes)
        buffer[: FRAME.size].view(torch.int64).copy_(torch.tensor(frame, dtype=torch.int64, device="cpu"))
        send = _Send(i, peer, call.seq, buffer)
        return Outgoing(buffer[FRAME.size : at].view(torch.int64), buffer[at:], send)

    def send(self, out: Outgoing) -> None:
        """Queue a filled message for ZeroMQ to send (copy-free); returns at once (`sent` waits for it
        to leave before the call returns)."""
        send: _Send = out.key
        tracker = self._put(send.peer, send.buffer.numpy())
        self._unsent = [(p, t) for p, t in self._unsent if not t.done]  # (calls that never wait: ll)
        if tracker is not None:
            self._unsent.append((send.peer, tracker))

    def sent(self) -> None:
        """Wait until ZeroMQ's I/O thread has taken every message this rank queued (into the socket:
        it then reaches its peer if this process dies), but not for a peer gone or masked, nor past
        the deadline (a stopped peer's socket may not drain: the peers name it). ZeroMQ moves them
        while this rank waits for its peers' messages, so after a call this usually waits for nothing."""
        deadline = time.monotonic() + self.timeout_s
        for peer, tracker in self._unsent:
            while not tracker.done and peer in self.live and not self._gone(peer):
                if (left_s := deadline - time.monotonic()) <= 0:
                    break
                try:
                    tracker.wait(min(left_s, SENT_POLL_S))
                except zmq.NotDone:
                    pass
        self._unsent = []

    def _put(self, peer: int, message: object) -> zmq.MessageTracker | None:
        """One message to `peer` (its tracker); a peer ZeroMQ cannot take it for is lost (a wait names
        it), and a cut one gets nothing (None either way)."""
        if peer in self._lost or peer in self.faults.cut:  # cut: a link down (tests, `ubep.faults`)
            return None
        try:
            return self._dealers[peer].send(message, zmq.NOBLOCK, copy=False, track=True)
        except zmq.ZMQError:
            self._lost.add(peer)
            return None

    def _tell_abort(self, culprit: int, how: int, seq: int) -> None:
        notice = FRAME.pack(ABORT, seq, how, culprit, 0)
        for p in self.peers:
            self._put(p, notice)

    def close(self) -> None:
        """Tell every peer this rank closes (BYE), then close every socket (queued messages get
        CLOSE_LINGER_S to leave) and the context."""
        if self._closed:
            return
        self._closed = True
        for p in self.peers:
            self._put(p, FRAME.pack(BYE, 0, 0, 0, 0))
        for dealer in self._dealers.values():
            dealer.disable_monitor()
        self._context.destroy(linger=int(1000 * min(CLOSE_LINGER_S, self.timeout_s)))


def _identity(rank: int) -> bytes:
    """How a DEALER names its rank to the ROUTERs it connects to."""
    return f"rank-{rank}".encode()  # ZeroMQ keeps identities that begin with a zero byte for itself

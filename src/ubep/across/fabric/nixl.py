"""The nixl fabric: messages as NIXL one-sided writes with a notification (UCX: TCP, InfiniBand, EFA).

    protocol -> [NixlFabric: WRITE outbox -> the peer's inbox slot, its notice after] -> NIXL -> UCX

Layout. Each rank registers, once at construction, one region of inboxes: per
lane, per peer of the lane and per half (the call's seq parity) a slot of the
lane's largest message (header words, then payload bytes), and per lane a pool
of outboxes (registered as it grows, which it does only while more messages are
in flight than it holds). The agents' metadata, each region's address and where
each peer's slots lie in it travel once over the Buffer's group, at construction
(the address table: no call computes a peer's address);
then every rank sends every peer a first notice and waits for theirs, so every
connection is up (or its peer named) before the first call.

Data as flag. A send is one WRITE of the message into its slot at the peer,
carrying a notification whose bytes are the frame (lane, half, seq, kind, header
words, payload bytes). NIXL sends a transfer's notification only once all of its
writes have completed at the target (UCX: the writes, a flush of the endpoint,
then the notification), so a receiver takes a slot only after its notice, and
takes the frame from the notice. Notices not bound to a transfer (credits,
aborts, pings) have no ordering guarantee, and need none.

Credits. A one-sided writer must not overwrite a slot its receiver still reads.
A writer holds one credit per (lane, peer, half): a write spends it, and the
receiver's notice returns it when it releases the slot (or drops an older call's
message from it). A message without its credit waits in a queue and is written
as soon as the credit is back: `send` never waits for its receiver, as gloo's
pre-posted receives give the gloo engine.

Progress. NIXL's progress thread polls without pause (4-10x slower with 8 ranks
on 2 cores), so the agent has none: every entry of this engine drives NIXL, and
waits do so between the `Waiter`'s yields and sleeps. UCX sends a transfer's
notification from that progress, so a receive half returns only once this
rank's own messages of the call are delivered: no rank leaves a call with a
message a peer still waits for.

Failures. A peer whose process exited is named at once: on this host by its
process, elsewhere by NIXL (`nixlRemoteDisconnectError` on a notice to it: a
long wait pings the peers it waits for). A stopped or silent peer is named at
the deadline (UCX reports a stopped peer, if at all, after its keepalive). A
rank that gives up on a call tells every peer with an abort notice (seq, kind,
culprit, whether it rejected its input); a message of a call the receiver gave
up on is dropped (a low-latency call whose receive half is still to come keeps
its messages), and a peer that gave up on a call and went on is named as such.
"""

from __future__ import annotations

import glob
import importlib
import logging
import os
import struct
import time
import uuid
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.distributed as dist

from ubep.across.fabric.base import Fabric, Frame, Lane, Outgoing, Slot, check_fits, notice_key
from ubep.calls import KINDS, CallId
from ubep.deadlines import PeerPids, collective_deadline, construction_s
from ubep.errors import CommTimeoutError
from ubep.extras import install_hint
from ubep.registry import NIXL
from ubep.waiting import AbortNotice, Waiter

BACKEND = "UCX"
INFINIBAND = "/sys/class/infiniband"  # RDMA devices; an EFA device's driver is "efa"
MESSAGE = struct.Struct("<cBBqqqq")  # b"M", lane, half, seq, kind, header words, payload bytes
CREDIT = struct.Struct("<cBB")  # b"C", lane, half: the sender freed this rank's slot at it
ABORT = struct.Struct("<cqqq")  # b"A", culprit + 1 (0: the sender itself), 2 kind + rejected, seq
PING = b"P"  # no content: a liveness probe, and construction's first notice
BYE = b"B"  # no content: the sender closes its Buffer, and sends this rank nothing more
CLOSE_GRACE_S = 2.0  # how long close() waits for the peers' BYE before it drops the agent
FAREWELL_POLL_S = 0.001  # between looks for the peers' BYE


def nixl_modules() -> tuple[ModuleType, ModuleType]:
    """NIXL's agent API and its bindings (for the disconnect error): the `nixl` meta package where
    installed (it picks the CUDA variant), else the nixl-cu12 or nixl-cu13 wheel (each runs on
    hosts without CUDA too). ImportError names the extra where none is installed. NIXL's logger
    then follows ubep's (`quiet_nixl`)."""
    without_efa_module()
    for name in ("nixl", "nixl_cu12", "nixl_cu13"):
        try:
            api = importlib.import_module(f"{name}._api"), importlib.import_module(f"{name}._bindings")
        except ModuleNotFoundError as error:
            if error.name != name:
                raise
            continue
        quiet_nixl()
        return api
    raise ImportError(f"fabric 'nixl' needs NIXL ({install_hint('nixl')})")


def without_efa_module(environ: MutableMapping[str, str] = os.environ, devices: str = INFINIBAND) -> bool:
    """On a host with no EFA device, and where the user set no UCX_MODULES: UCX without its EFA module.

    NIXL 1.5.1's wheel loads the host's `libefa` (installed with rdma-core, which Open MPI's packages
    pull in) beside its own `libnl-route`, and the process then dies with SIGSEGV at exit, which a
    launcher that checks exit codes reports as a failed rank (docs/multinode.md). UCX reads its modules
    when the agent is made, from the environment only: so this sets the variable, once, before the
    first agent. Returns whether it did. A host with EFA keeps the module (it carries the traffic)."""
    if "UCX_MODULES" in environ or any(
        os.path.basename(os.path.realpath(driver)) == "efa"
        for driver in glob.glob(f"{devices}/*/device/driver")
    ):
        return False
    environ["UCX_MODULES"] = "^efa"
    return True


def quiet_nixl(environ: Mapping[str, str] = os.environ) -> None:
    """NIXL's Python logger ("nixl", INFO on stdout by NIXL's own configuration) at ubep's level, unless
    the user chose one with NIXL_LOG_LEVEL: two INFO lines per agent would otherwise interleave with
    a program's output whatever `UBEP_LOG_LEVEL` says."""
    if "NIXL_LOG_LEVEL" not in environ:
        logging.getLogger("nixl").setLevel(
            logging.getLogger("ubep").getEffectiveLevel()
        )  # `ubep.settings.LOGGER`


def _slot_bytes(lane: Lane) -> int:
    """A slot: the lane's header words, then its payload (8-byte aligned, so slots stay aligned)."""
    return 8 * lane.words + -(-lane.nbytes // 8) * 8


def _peers_of(lane: Lane, rank: int, num_ranks: int) -> list[int]:
    """The ranks `rank` exchanges messages with on `lane` (every other rank, or the lane's own)."""
    return [p for p in range(num_ranks) if p != rank and (lane.peers is None or p in lane.peers)]


def _inbox_layout(
    lanes: Sequence[Lane], rank: int, num_ranks: int
) -> tuple[dict[tuple[int, int, int], int], int]:
    """(where each slot of `rank`'s inbox region starts: (lane, peer, half) -> byte offset, the
    region's bytes): lanes, then the lane's peers ascending, then halves."""
    at, slots = 0, {}
    for i, lane in enumerate(lanes):
        for p in _peers_of(lane, rank, num_ranks):
            for h in (0, 1):
                slots[(i, p, h)] = at
                at += _slot_bytes(lane)
    return slots, at


@dataclass(slots=True)
class _Send:
    """One message from its outbox to its slot at `peer`; `xfer` is NIXL's transfer once posted."""

    lane: int
    peer: int
    seq: int
    kind: int
    words: int
    nbytes: int
    buffer: torch.Tensor  # uint8, a registered outbox
    xfer: object | None = None

    @property
    def slot(self) -> tuple[int, int, int]:
        return self.lane, self.peer, self.seq % 2


class NixlFabric(Fabric):
    """One rank's end of the fabric: a NIXL agent without a progress thread. Collective to build."""

    name = NIXL.name

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        rank: int,
        num_ranks: int,
        lanes: Sequence[Lane],
        timeout_s: float,
    ):
        api, bindings = nixl_modules()
        self._lost_error = bindings.nixlRemoteDisconnectError
        super().__init__(rank, num_ranks, lanes, timeout_s)
        lanes = self._lanes  # with the fabric's own
        self._slots, inbox_bytes = _inbox_layout(lanes, rank, num_ranks)
        config = api.nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=False, backends=[BACKEND]
        )
        self._agent = api.nixl_agent(f"ubep-{rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}", config)
        self._regions: list[tuple[torch.Tensor, object]] = []  # (memory, its registration), kept to close
        self._inbox = self._register(inbox_bytes)
        self._pool: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(lanes))}  # free outboxes
        for i, lane in enumerate(lanes):
            self._grow(i, 2 * len(_peers_of(lane, rank, num_ranks)))
        self._landed: dict[tuple[int, int, int], tuple[int, int, int, int]] = {}  # slot -> its frame
        self._credits = set(self._slots)  # (lane, peer, half): this rank may write its slot at peer
        self._queued: list[_Send] = []  # sent, waiting for their credit
        self._in_flight: list[_Send] = []  # written, not yet complete
        self._failed: list[_Send] = []  # to a lost peer, NIXL would not release them: kept to close
        self._lost: set[int] = set()  # peers NIXL reported disconnected
        self._greeted: set[int] = set()  # peers whose first notice arrived
        self._closing: set[int] = set()  # peers that closed their Buffer (their BYE arrived)
        self._closed = False
        self._connect(group, timeout_s)

    # -- construction -----------------------------------------------------------------------------

    def _register(self, nbytes: int) -> torch.Tensor:
        memory = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
        if nbytes:
            self._regions.append((memory, self._agent.register_memory(memory)))
        return memory

    def _grow(self, lane: int, count: int) -> None:
        """`count` more outboxes for `lane`, in one registered region."""
        size = _slot_bytes(self._lanes[lane])
        self._pool[lane].extend(self._register(count * size).split(size) if count else ())

    def _connect(self, group: dist.ProcessGroup | None, timeout_s: float) -> None:
        """Exchange every agent's metadata, inbox address and slots once, over the Buffer's group (no
        group of its own: `dist.new_group` needs every rank of the world, which a Buffer on a subgroup
        cannot ask of the others); then greet every peer and wait for their greeting (each connection
        is up, or named). Construction's deadline throughout (`construction_s`)."""
        mine = (self._agent.name, self._agent.get_agent_metadata(), self._inbox.data_ptr(), self._slots)
        everyone: list[tuple[str, bytes, int, dict] | None] = [None] * self.num_ranks
        with collective_deadline(group, construction_s(timeout_s), "Buffer construction (fabric)"):
            self._pids = PeerPids.gather(group, self.rank, self.num_ranks)
            dist.all_gather_object(everyone, mine, group=group)
        for p in self.peers:
            self._agent.add_remote_agent(everyone[p][1])
        self._names = {p: everyone[p][0] for p in self.peers}  # as notices name their sender
        self._rank_of = {name: p for p, name in self._names.items()}
        self._there = {  # (lane, peer, half) -> the address of this rank's slot in peer's inbox
            (i, p, h): everyone[p][2] + at
            for p in self.peers
            for (i, src, h), at in everyone[p][3].items()
            if src == self.rank
        }
        for p in self.peers:
            self._notify(p, PING)
        first = "Buffer construction (fabric: first notices)"
        waiter = Waiter(first, construction_s(timeout_s), self._gone, lambda p: None)
        while pending := [p for p in self.peers if p not in self._greeted]:
            self._progress()
            self._pause(waiter, pending)

    # -- progress ---------------------------------------------------------------------------------

    def _progress(self) -> None:
        """Drive NIXL: take the notices that arrived, complete transfers, write queued messages."""
        for name, blobs in self._agent.get_new_notifs().items():
            peer = self._rank_of.get(name)
            for blob in blobs if peer is not None else ():
                self._take_notice(peer, blob)
        self._complete()
        self._write_queued()

    def _take_notice(self, peer: int, blob: bytes) -> None:
        tag = blob[:1]
        if tag == b"M" and len(blob) == MESSAGE.size:
            _, lane, half, seq, kind, words, nbytes = MESSAGE.unpack(blob)
            slot = (lane, peer, half)
            if slot not in self._slots or slot in self._landed:
                self._bad[peer] = f"wrote lane {lane}, half {half} out of turn (no slot or no credit)"
            else:
                self._landed[slot] = (seq, kind, words, nbytes)
        elif tag == b"C" and len(blob) == CREDIT.size:
            _, lane, half = CREDIT.unpack(blob)
            if (lane, peer, half) in self._there:
                self._credits.add((lane, peer, half))
        elif tag == b"A" and len(blob) == ABORT.size:
            self._take_abort(peer, *ABORT.unpack(blob)[1:])
        elif blob == PING:
            self._greeted.add(peer)
        elif blob == BYE:
            self._closing.add(peer)
        else:
            self._bad[peer] = f"sent a notice of {len(blob)} bytes this rank cannot read"

    def _complete(self) -> None:
        """Transfers that completed free their outboxes; one that failed marks its peer lost."""
        going = []
        for send in self._in_flight:
            try:
                state = self._agent.check_xfer_state(send.xfer)
            except self._lost_error:
                state = "ERR"
            if state == "PROC":
                going.append(send)
            else:
                self._retire(send, lost=state != "DONE")
        self._in_flight = going

    def _retire(self, send: _Send, lost: bool) -> None:
        if lost:
            self._lost.add(send.peer)
        try:
            send.xfer.release()
        except Exception:  # NIXL could not cancel a transfer to a lost peer: its outbox stays with it
            self._failed.append(send)
            return
        self._pool[send.lane].append(send.buffer)

    def _gone(self, peer: int) -> bool:
        """The Waiter's peer_gone: `peer` exited (its process, on this host) or NIXL lost it (a ping
        to it fails once the connection is gone)."""
        if peer not in self._lost and (peer in self._closing or peer in self._pids.dead()):
            self._lost.add(peer)
        if peer not in self._lost:
            self._notify(peer, PING)
        return peer in self._lost

    def _notify(self, peer: int, blob: bytes) -> None:
        """A notice bound to no transfer (no ordering); a lost peer is noted, not raised."""
        try:
            self._agent.send_notif(self._names[peer], blob)
        except self._lost_error:
            self._lost.add(peer)

    # -- receiving --------------------------------------------------------------------------------

    def _landed_frame(self, slot: Slot) -> Frame | None:
        """The slot's frame once its notice came (NIXL sends it after the write completed)."""
        return self._landed.get(slot)

    def _contents(self, slot: Slot, words: int, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        at = self._slots[slot]
        return self._inbox[at : at + 8 * words].view(torch.int64), self._inbox[at + 8 * words :][:nbytes]

    def _drop(self, slot: Slot) -> None:
        self._release(slot)

    def _occupied(self) -> list[Slot]:
        return list(self._landed)

    def _notice_of(self, call: CallId) -> Callable[[int], AbortNotice | None]:
        return lambda peer: self._notices.get(notice_key(peer, call.seq, KINDS[call.kind]))

    def _settle(self, lane: int, call: CallId, waiter: Waiter) -> None:
        """Until this rank's own messages of the call are delivered."""
        while True:
            self._progress()
            if not (late := self._undelivered(lane, call)):
                return
            self._pause(waiter, late)

    def _pause(self, waiter: Waiter, pending: list[int]) -> None:
        """`waiter.pause`; its error says "died or closed its Buffer" of a peer NIXL lost whose exit this
        rank cannot see (closing a Buffer ends its connections too), not "process exited"."""
        try:
            waiter.pause(pending)
        except CommTimeoutError as error:
            exited = set(self._pids.dead())
            if not (closed := [p for p in error.dead_peers if p not in exited]):
                raise
            raise CommTimeoutError(
                error.phase, error.peers, error.timeout_s, error.dead_peers, closed=closed
            ) from None

    def _undelivered(self, lane: int, call: CallId) -> list[int]:
        """Peers still without this rank's message of `call` on `lane` (a lost peer, or one that gave
        up on the call, is not waited for)."""
        late = {s.peer for s in self._queued + self._in_flight if (s.lane, s.seq) == (lane, call.seq)}
        return sorted(
            p
            for p in late
            if p not in self._lost and notice_key(p, call.seq, KINDS[call.kind]) not in self._notices
        )

    def release(self, lane: str, peer: int, call: CallId) -> None:
        self._release((self.lanes[lane], peer, call.seq % 2))

    def _release(self, slot: Slot) -> None:
        """Free `slot` for its peer's next message: its credit goes back."""
        lane, peer, half = slot
        self._landed.pop(slot, None)
        self._notify(peer, CREDIT.pack(b"C", lane, half))

    # -- sending ----------------------------------------------------------------------------------

    def outbox(self, lane: str, peer: int, call: CallId, words: int, nbytes: int) -> Outgoing:
        """A message to fill for `peer`, in a registered outbox no send in flight uses."""
        i = self.lanes[lane]
        check_fits(self._lanes[i], peer, call, words, nbytes)
        if not self._pool[i]:
            self._grow(i, 1)
        send = _Send(i, peer, call.seq, KINDS[call.kind], words, nbytes, self._pool[i].pop())
        at = 8 * words
        return Outgoing(send.buffer[:at].view(torch.int64), send.buffer[at : at + nbytes], send)

    def send(self, out: Outgoing) -> None:
        """Write the message once its slot's credit is here (now, or from a later progress)."""
        self._queued.append(out.key)
        self._progress()

    def _write_queued(self) -> None:
        waiting = []
        for send in self._queued:
            if send.peer in self._lost:
                self._pool[send.lane].append(send.buffer)
            elif send.slot in self._credits:
                self._credits.remove(send.slot)
                self._write(send)
            else:
                waiting.append(send)
        self._queued = waiting

    def _write(self, send: _Send) -> None:
        """One WRITE of header and payload into the peer's slot; the frame is its notification."""
        size = 8 * send.words + send.nbytes
        there = self._there[send.slot]
        frame = MESSAGE.pack(b"M", send.lane, send.seq % 2, send.seq, send.kind, send.words, send.nbytes)
        agent = self._agent
        try:
            send.xfer = agent.initialize_xfer(
                "WRITE",
                agent.get_xfer_descs([(send.buffer.data_ptr(), size, 0)], "DRAM"),
                agent.get_xfer_descs([(there, size, 0)], "DRAM"),
                self._names[send.peer],
                frame,
            )
            state = agent.transfer(send.xfer)
        except self._lost_error:
            self._lost.add(send.peer)
            self._pool[send.lane].append(send.buffer)
            return
        if state == "ERR":
            self._retire(send, lost=True)
        else:
            self._in_flight.append(send)

    def _tell_abort(self, culprit: int, how: int, seq: int) -> None:
        notice = ABORT.pack(b"A", culprit, how, seq)
        for p in self.peers:
            self._notify(p, notice)
        self._progress()

    def close(self) -> None:
        """Cancel what is still in flight (to a lost or stopped peer), deregister, drop the agent."""
        if self._closed:
            return
        self._closed = True
        self._farewell()
        for send in self._in_flight:
            try:
                send.xfer.release()
            except Exception:  # a transfer NIXL cannot cancel dies with the agent
                self._failed.append(send)
        self._in_flight, self._queued = [], []
        for _, registration in self._regions:
            self._agent.deregister_memory(registration)
        for name in self._names.values():
            self._agent.remove_remote_agent(name)
        self._agent = None

    def _farewell(self) -> None:
        """Tell every peer this rank closes, and wait (at most CLOSE_GRACE_S) for theirs: a peer still
        returning credits for the last call's messages would otherwise write to a dropped agent, and
        NIXL logs that as an error (NIXL_ERR_REMOTE_DISCONNECT) on a clean exit."""
        for peer in self.peers:
            if peer not in self._lost:
                self._notify(peer, BYE)
        end = time.monotonic() + min(CLOSE_GRACE_S, self.timeout_s)
        while any(p not in self._closing and p not in self._lost for p in self.peers):
            if time.monotonic() > end:
                return
            self._progress()
            time.sleep(FAREWELL_POLL_S)

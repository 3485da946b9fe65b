"""Shared segments as a `Heap`'s memory: the ranks are processes of one host.

The segments themselves (creation, mapping, unlinking, the stale sweep) are
`ubep.transport.segments`; a sleeping peer is woken through its doorbell (`ubep.doorbell`).
Plain loads and stores into the mappings are the puts, signals and waits; the
memory-ordering argument is in docs/design.md.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from ubep.doorbell import Doorbell
from ubep.errors import RejoinError
from ubep.transport.base import Header, Region
from ubep.transport.heap import CTL_KEY, KEY_WORDS, Heap, Layout
from ubep.transport.segments import Creator, SegmentLayout, SymmetricHeap

STORE_CONNECT_S = 60  # how long a rejoining process tries to reach the job's store


@dataclass(frozen=True, slots=True)
class Rejoining:
    """The "group" of a process restarting as `rank` of a running job of `world_size` ranks on this
    host (`Buffer.rejoin`): it cannot enter the survivors' process group, so it finds them through the
    job's rendezvous `store` (torchrun's agent store, or the launcher's: MASTER_ADDR/MASTER_PORT).

    `stages`: when each stage of the rejoin ended, as (`time.time()`, comparable with a launcher's
    clock; `time.process_time()`, this process's CPU seconds, which a shared host does not stretch),
    in order: "store" (connected), "kernels" (loaded or compiled), "options" (checked against the
    store's), "holdings" (the live ranks' read from the store), "segments" (mapped), "exchange"
    (built), "survivors' dispatch" (the one that takes it in began) and "agreed".
    """

    rank: int
    world_size: int
    store: dist.Store
    stages: dict[str, tuple[float, float]] = field(default_factory=dict, compare=False)

    def stamp(self, stage: str) -> None:
        """`stage` of the rejoin ended now."""
        self.stages[stage] = (time.time(), time.process_time())

    @classmethod
    def of(cls, rank: int, world_size: int, store: dist.Store | None) -> Rejoining:
        """`store`, or a client of the one at MASTER_ADDR:MASTER_PORT (where torchrun and plain
        launchers rendezvous; the restarted process gets the same environment)."""
        if store is None:
            host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
            if not host or not port:
                raise RejoinError(
                    f"rank {rank} rejoining: no store given and MASTER_ADDR/MASTER_PORT unset: pass the "
                    "job's rendezvous store (a torch.distributed TCPStore client)"
                )
            store = dist.TCPStore(host, int(port), None, False, timedelta(seconds=STORE_CONNECT_S))
        joining = cls(rank, world_size, store)
        joining.stamp("store")
        return joining


def holding_key(world_size: int, rank: int) -> str:
    """Where rank `rank` of a `world_size`-rank job keeps its `Holding` in the rendezvous store."""
    return f"ubep/rejoin/{world_size}/{rank}"


def job_store() -> dist.Store | None:
    """The store the default process group rendezvoused through, without the prefix torch puts on its
    own keys (what a client of MASTER_ADDR:MASTER_PORT reads); None where not initialised."""
    if not dist.is_initialized():
        return None
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


@dataclass(frozen=True, slots=True)
class Holding:
    """What one rank of a running job tells a process restarting in a dead rank's place (through the
    job's rendezvous store): who it is, each segment's name, and the file of each it holds open."""

    process: Creator
    rank: int
    names: tuple[str, ...]
    fds: tuple[int, ...]

    def dumps(self) -> str:
        """JSON (not pickle: the store is readable and writable by every process of the job)."""
        p = self.process
        return json.dumps(
            {"process": [p.pid, p.pid_ns, p.start], "rank": self.rank, "names": self.names, "fds": self.fds}
        )

    @classmethod
    def loads(cls, text: bytes) -> Holding:
        got = json.loads(text)
        return cls(
            Creator(*(int(w) for w in got["process"])),
            int(got["rank"]),
            tuple(got["names"]),
            tuple(int(f) for f in got["fds"]),
        )


class SharedSegments:
    """Every rank's segment mapped here, and the doorbells (the `Memory` of a host's heap)."""

    def __init__(self, layout: Layout, group: dist.ProcessGroup, rank: int, world_size: int):
        segment = SegmentLayout()
        segment.add("arena", (layout.nbytes,), torch.uint8)
        self._ring(SymmetricHeap(segment, group, rank, world_size, touchable=layout.touchable), rank)

    @classmethod
    def rejoin(cls, layout: Layout, rank: int, holding: Holding) -> SharedSegments:
        """Every segment of a running job mapped through the files `holding`'s rank keeps open, this
        process taking rank `rank`'s over (emptied); the doorbells' secret read from that rank's
        control block, where only processes that map the segments can read it."""
        segment = SegmentLayout()
        segment.add("arena", (layout.nbytes,), torch.uint8)
        heap = SymmetricHeap.attach_from(
            segment, rank, list(holding.names), holding.process, list(holding.fds)
        )
        segments = cls.__new__(cls)
        at = layout.offsets[("ctl", 0)][0] + 8 * CTL_KEY
        heap.doorbell_key = heap.tensor(holding.rank, "arena")[at : at + 8 * KEY_WORDS].numpy().tobytes()
        segments._ring(heap, rank)
        return segments

    def _ring(self, segments: SymmetricHeap, rank: int) -> None:
        self._segments = segments
        try:
            self._doorbell = Doorbell(segments.names[rank], segments.doorbell_key)
        except BaseException:
            segments.close()
            raise
        self._doorbell.connect(segments.names)
        self.creators = segments.creators  # each rank's process, for liveness checks

    def holding(self) -> Holding:
        """This rank's `Holding`, for a process that restarts in a dead rank's place."""
        s = self._segments
        return Holding(Creator.this_process(), s.rank, tuple(s.names), tuple(s.fds))

    @property
    def secret(self) -> np.ndarray:
        """int64 [KEY_WORDS]: the doorbells' secret, for this rank's control block."""
        return np.frombuffer(self._segments.doorbell_key, dtype=np.int64)

    def arena(self, owner: int) -> torch.Tensor:
        return self._segments.tensor(owner, "arena")

    def ring(self, peer: int) -> None:
        self._doorbell.ring(peer)

    def sleep(self, timeout_s: float) -> None:
        self._doorbell.wait(timeout_s)

    def close(self) -> None:
        self._doorbell.close()
        self._segments.close()


def shm_heap(
    blocks: Iterable[Region | Header], group: dist.ProcessGroup, rank: int, world_size: int, timeout_s: float
) -> Heap:
    """Collective: every rank of `group` maps every rank's segment holding `blocks`."""
    layout = Layout(world_size, blocks)
    segments = SharedSegments(layout, group, rank, world_size)
    heap = Heap(layout, segments, rank, world_size, timeout_s)
    heap.learn_peers(segments.creators)
    heap.introduce(segments.creators[rank], segments.secret)
    store = job_store()
    if store is not None:  # what a process restarting in a dead rank's place maps the segments through
        store.set(holding_key(world_size, rank), segments.holding().dumps())
    dist.barrier(group=group)  # every doorbell is ready before the first wait
    return heap


def rejoined_heap(blocks: Iterable[Region | Header], group: Rejoining, timeout_s: float) -> Heap:
    """The heap of a process restarting as `group.rank` of a running job: every segment mapped through
    the files a live rank holds open (its `Holding` from the store), this rank's emptied; not yet
    taken in (`Heap.join`)."""
    rank, world_size = group.rank, group.world_size
    layout = Layout(world_size, blocks)
    mine = _holding(group.store, world_size, rank)
    if mine is not None and not mine.process.is_gone():
        raise RejoinError(
            f"rank {rank} rejoining: its previous process (pid {mine.process.pid}) still runs; a rank "
            "rejoins only once its old process has exited"
        )
    holdings = [_holding(group.store, world_size, r) for r in range(world_size) if r != rank]
    live = [h for h in holdings if h is not None and not h.process.is_gone()]
    group.stamp("holdings")
    if not live:
        raise RejoinError(
            f"rank {rank} rejoining: no live rank of a {world_size}-rank job on this host left a record "
            "in the rendezvous store (its Buffer on transport 'shm' writes one)"
        )
    segments = SharedSegments.rejoin(layout, rank, live[0])
    heap = Heap(layout, segments, rank, world_size, timeout_s)
    heap.introduce(Creator.this_process(), segments.secret)
    heap.learn_peers([heap.identity(r) for r in range(world_size)])
    group.store.set(holding_key(world_size, rank), segments.holding().dumps())
    group.stamp("segments")
    return heap


def _holding(store: dist.Store, world_size: int, rank: int) -> Holding | None:
    key = holding_key(world_size, rank)
    return Holding.loads(store.get(key)) if store.check([key]) else None

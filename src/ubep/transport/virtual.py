"""Virtual ranks: R ranks' memory in one address space, each rank a thread of one process.

The same `Heap`, the same protocols and kernels as on shared segments, but
driven from one process: for tests that need no rank processes, and for
measuring kernels on one device. Torch's copies and the compiled kernels
release the GIL, so the ranks' data movement really runs concurrently.

    world = VirtualWorld(4)
    results = world.run(lambda rank: moe_step(ubep.Buffer(rank, hidden=..., ...)))

`Buffer(group=rank)` with a `VirtualRank` builds its transport here; the
group operations it needs at construction (gather an object, a barrier) are
the world's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ubep.errors import CommTimeoutError
from ubep.transport.base import Header, Region
from ubep.transport.heap import Heap, Layout
from ubep.waiting import AbortNotice, PeerAbortedError


class VirtualWorld:
    """R ranks in one process: their memory, their wake-ups, and the group operations among them.

    Once a rank's function raises, the world is failed: every rank blocked in a
    group operation or a wait on a peer raises `PeerAbortedError` naming that rank,
    at once rather than at the deadline.
    """

    def __init__(self, num_ranks: int, timeout_s: float = 60.0):
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        self.num_ranks = num_ranks
        self.timeout_s = timeout_s
        self._barrier = threading.Barrier(num_ranks)
        self._wakeups = [threading.Event() for _ in range(num_ranks)]
        self._slots: list[Any] = [None] * num_ranks
        self._lock = threading.Lock()
        self._at_barrier: set[int] = set()  # ranks inside `barrier` now
        self._silent: list[int] | None = None  # who was missing when the barrier first broke
        self._failure: tuple[int, BaseException] | None = None  # the first rank whose function raised
        self._posts = threading.Condition()  # guards the two dicts below (`all_gather_among`)
        self._rounds: dict[tuple[tuple[int, ...], int], int] = {}  # (ranks, rank): its gathers among them
        self._boards: dict[tuple[tuple[int, ...], int], dict[int, Any]] = {}  # (ranks, round): the posts
        self._readers: dict[tuple[tuple[int, ...], int], int] = {}  # (ranks, round): ranks that read it

    def all_gather(self, rank: int, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (collective over the world's threads)."""
        self._slots[rank] = obj
        self.barrier(rank)
        everyone = list(self._slots)
        self.barrier(rank)  # nobody overwrites a slot before all have read
        return everyone

    def all_gather_among(self, rank: int, ranks: tuple[int, ...], obj: Any, phase: str) -> dict[int, Any]:
        """Each of `ranks`' `obj` by rank: a collective among them alone (the world's other ranks
        need not come), as the staying ranks of a Buffer that masked some gather. Every one of
        `ranks` passes the same tuple; their n-th gathers among it pair up. A rank missing at the
        world's timeout is named (CommTimeoutError, in `phase`)."""
        deadline = time.monotonic() + self.timeout_s
        with self._posts:
            n = self._rounds.get((ranks, rank), 0)
            self._rounds[ranks, rank] = n + 1
            board = self._boards.setdefault((ranks, n), {})
            board[rank] = obj
            self._posts.notify_all()
            while len(board) < len(ranks):
                self._raise_if_failed(phase)
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [r for r in ranks if r not in board]
                    raise CommTimeoutError(phase, missing, self.timeout_s, [])
                self._posts.wait(left)
            got = dict(board)
            self._readers[ranks, n] = self._readers.get((ranks, n), 0) + 1
            if self._readers[ranks, n] == len(ranks):  # every one read it
                del self._boards[ranks, n], self._readers[ranks, n]
        return got

    def barrier(self, rank: int) -> None:
        """Wait for every rank; raise naming the failed rank, or the ranks that never came."""
        with self._lock:
            self._at_barrier.add(rank)
        try:
            self._barrier.wait(self.timeout_s)
        except threading.BrokenBarrierError:
            with self._lock:  # the first rank out sees everyone who was waiting still inside
                if self._silent is None:
                    self._silent = sorted(set(range(self.num_ranks)) - self._at_barrier)
            self._raise_if_failed("virtual world barrier")
            raise CommTimeoutError("virtual world barrier", self._silent, self.timeout_s, []) from None
        finally:
            with self._lock:
                self._at_barrier.discard(rank)

    def ring(self, peer: int) -> None:
        self._wakeups[peer].set()

    def sleep(self, rank: int, timeout_s: float) -> None:
        """Block until rung or `timeout_s` passes; raise once another rank has failed."""
        self._raise_if_failed("virtual world (waiting on a peer)")
        event = self._wakeups[rank]
        event.wait(max(timeout_s, 0.0))
        event.clear()
        self._raise_if_failed("virtual world (waiting on a peer)")

    def _raise_if_failed(self, phase: str) -> None:
        if self._failure is not None:
            rank, error = self._failure
            raise PeerAbortedError(phase, rank, AbortNotice(f"its function raised {error!r}"))

    def _fail(self, rank: int, error: BaseException) -> None:
        """Record rank's failure (the first one is the world's cause), then wake every waiting rank."""
        with self._lock:
            if self._failure is None:
                self._failure = (rank, error)
        self._barrier.abort()
        with self._posts:
            self._posts.notify_all()
        for event in self._wakeups:
            event.set()

    def run(self, fn: Callable[[VirtualRank], Any]) -> list[Any]:
        """Run fn(rank) on every rank, each in its own thread, with `rank` a `VirtualRank` (its
        index is `rank.rank`; pass it as a Buffer's `group`); each rank's result, in rank order.

        The first rank to fail has its exception re-raised, naming it: the others' errors
        only follow from it. A rank still running at the world's timeout raises
        CommTimeoutError; its thread is a daemon, so it does not keep the interpreter alive.
        """
        results: list[Any] = [None] * self.num_ranks

        def body(rank: int) -> None:
            try:
                results[rank] = fn(VirtualRank(self, rank))
            except BaseException as err:  # re-raised below, in the caller's thread
                self._fail(rank, err)

        threads = [
            threading.Thread(target=body, args=(r,), name=f"ubep-virtual-{r}", daemon=True)
            for r in range(self.num_ranks)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + self.timeout_s
        for t in threads:
            t.join(max(deadline - time.monotonic(), 0.0))
        if self._failure is not None:
            rank, error = self._failure
            raise RuntimeError(f"virtual rank {rank} failed: {error!r}") from error
        stuck = [r for r, t in enumerate(threads) if t.is_alive()]
        if stuck:
            raise CommTimeoutError("virtual world run", stuck, self.timeout_s, [])
        return results


@dataclass(frozen=True, slots=True)
class VirtualRank:
    """One rank of a `VirtualWorld`: pass it as a Buffer's `group`."""

    world: VirtualWorld
    rank: int

    @property
    def world_size(self) -> int:
        return self.world.num_ranks


class VirtualMemory:
    """The `Memory` of one rank of a virtual world: arenas allocated once, shared by all ranks."""

    def __init__(self, me: VirtualRank, nbytes: int):
        self._me = me
        mine = torch.zeros(max(nbytes, 1), dtype=torch.uint8, device="cpu")
        self._arenas: list[torch.Tensor] = me.world.all_gather(me.rank, mine)

    def arena(self, owner: int) -> torch.Tensor:
        return self._arenas[owner]

    def ring(self, peer: int) -> None:
        self._me.world.ring(peer)

    def sleep(self, timeout_s: float) -> None:
        self._me.world.sleep(self._me.rank, timeout_s)

    def close(self) -> None:
        self._arenas = []


def virtual_heap(blocks: Iterable[Region | Header], me: VirtualRank, timeout_s: float) -> Heap:
    """Collective over the world: every rank's arena holding `blocks`."""
    layout = Layout(me.world_size, blocks)
    return Heap(layout, VirtualMemory(me, layout.nbytes), me.rank, me.world_size, timeout_s)

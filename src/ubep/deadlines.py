"""Deadlines for torch.distributed collectives, and errors that name the peers.

Shared-memory waits keep their own deadline (`ubep.waiting`); collectives wait
inside the backend, which keeps the process group's timeout (30 minutes by
default). `collective_deadline` sets the gloo backend's timeout to the
Buffer's `timeout_s` for the duration of ubep's own collectives, restores it
afterwards, and turns a backend failure into `CommTimeoutError`. Construction
waits `construction_s(timeout_s)` instead, in every layer.

What a backend failure can tell: gloo reports a dead peer at once ("connection
reset") and a silent one at the deadline, but by socket address, not by rank.
Where peers run on this host, their processes (see `PeerPids`) say which died or
is stopped; a stall between hosts can only be reported as "one of these ranks",
and a connection lost before the deadline as "did not arrive".

NCCL groups (CUDA) keep their own timeout: not changed here.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ubep.errors import CommTimeoutError, UbepError
from ubep.waiting import ProcessId

DEATH_GRACE_S = 0.5  # how long a failed collective looks for a dead local peer
LINGER_S = 0.3  # how long a rank that named a dead peer stays alive before raising (see _timeout_error)
WATCH_PERIOD_S = 0.02  # how often a `DeathWatch` looks at its peers
REASON_CHARS = 200  # how much of a backend's first line an error quotes (cut at a sentence end)
# Construction waits at least this long: ranks reach it at different times (imports, model loading,
# a loaded host), which says nothing about a stalled exchange.
CONSTRUCTION_MIN_TIMEOUT_S = 10.0


def construction_s(timeout_s: float) -> float:
    """The deadline (seconds) of every wait while a Buffer is built, given its calls' `timeout_s`.

    One rule for every layer that builds something collectively (a fabric's group, a pid exchange, a
    rail group), so that none of them waits a call's deadline inside construction: a rank that reaches
    a layer's construction late (load, a slow import) is not a stalled call."""
    return max(timeout_s, CONSTRUCTION_MIN_TIMEOUT_S)


@dataclass(frozen=True, slots=True)
class PeerPids:
    """Each rank's process where it runs on this host (None elsewhere), for liveness checks.

    Identities, not bare pids (see `ProcessId`): a peer in another PID namespace is
    never judged dead or stopped, only reported at the deadline."""

    rank: int
    processes: tuple[ProcessId | None, ...]

    @classmethod
    def of(cls, rank: int, everyone: Sequence[tuple[str, ProcessId]]) -> PeerPids:
        """From every rank's `here()`, in rank order."""
        host = socket.gethostname()
        return cls(rank, tuple(process if h == host else None for h, process in everyone))

    @classmethod
    def gather(cls, group: dist.ProcessGroup, rank: int, world_size: int) -> PeerPids:
        """Collective: every rank learns which peers share its host, and who they are."""
        everyone: list[tuple[str, ProcessId] | None] = [None] * world_size
        dist.all_gather_object(everyone, here(), group=group)
        return cls.of(rank, everyone)

    def dead(self) -> list[int]:
        return [r for r, p in enumerate(self.processes) if p is not None and p.is_gone()]

    def stopped(self) -> list[int]:
        return [r for r, p in enumerate(self.processes) if p is not None and p.is_stopped()]

    def dead_after_grace(self) -> list[int]:
        """Dead peers, looking again for a moment: a killed peer's sockets close (and
        gloo reports it) a little before its process shows as exited."""
        deadline = time.monotonic() + DEATH_GRACE_S
        while not (dead := self.dead()) and time.monotonic() < deadline:
            time.sleep(0.02)
        return dead


def here() -> tuple[str, ProcessId]:
    """What this rank tells its peers for `PeerPids`: its host and its process."""
    return socket.gethostname(), ProcessId.this_process()


class DeathWatch:
    """The local peers seen exited first, noted by a thread while a block of collectives runs.

    A collective may report a death late: in gloo's ring all-gather a survivor hears of a
    killed rank only when its neighbour, another survivor, gives up and exits, and by then
    both are gone. The peers seen gone first are the ones that died first."""

    def __init__(self, peers: PeerPids):
        self._peers = peers
        self._first: list[int] = []
        self._looks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ubep-death-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_PERIOD_S):
            self._looks += 1
            if dead := self._peers.dead():
                self._first = dead
                return

    def first_dead(self, grace_s: float) -> tuple[list[int], bool]:
        """(the first peers seen exited, waiting up to `grace_s` for one; whether their order is
        unknown: several were already gone at the watch's first look)."""
        self._thread.join(grace_s)
        return self._first, len(self._first) > 1 and self._looks == 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _gloo(group: dist.ProcessGroup | None):
    """The group's gloo backend, or None (no group, or not gloo)."""
    if group is None or not hasattr(dist, "ProcessGroupGloo"):
        return None
    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError:
        return None
    return backend if isinstance(backend, dist.ProcessGroupGloo) else None


def _from_backend(error: BaseException) -> bool:
    """Whether `error` is a failure reported by the collective backend (not ours, not a bug)."""
    if isinstance(error, UbepError):
        return False
    return type(error) is RuntimeError or isinstance(error, dist.DistError)


@contextmanager
def collective_deadline(
    group: dist.ProcessGroup | None,
    timeout_s: float,
    phase: str,
    peers: PeerPids | None = None,
    names: tuple[int, ...] | None = None,
    watch: bool = False,
) -> Iterator[None]:
    """Run the block's collectives under a `timeout_s` deadline; name the peers if one fails.

    `names[i]` is how errors name the group's rank i (default: i), e.g. its rank in
    the EP group when `group` is a subgroup of it. `watch` (with `peers`): keep a
    `DeathWatch` for the block, for long blocks (construction) where a death may be
    reported late; one thread per block, so not for per-call collectives.
    """
    backend = _gloo(group)
    previous = backend.options._timeout if backend is not None else None
    if backend is not None:
        backend._set_default_timeout(timedelta(seconds=timeout_s))
    watcher = DeathWatch(peers) if watch and peers is not None else None
    try:
        yield
    except BaseException as error:
        if not _from_backend(error):
            raise
        failure = _timeout_error(group, timeout_s, phase, peers, error, names, watcher)
        if not failure.dead_peers and _timed_out(error):
            _note_gave_up(group)  # its deadline passed: say so before this rank raises, and perhaps exits
        raise failure from error
    finally:
        if watcher is not None:
            watcher.stop()
        if backend is not None:
            backend._set_default_timeout(previous)


GAVE_UP_KEY = "ubep-gave-up/{rank}"  # in the group's store: when this rank gave up on a collective


def _store(group: dist.ProcessGroup | None):
    """The group's rendezvous store, or None where torch does not expose it."""
    try:
        return None if group is None else dist.distributed_c10d._get_process_group_store(group)
    except (AttributeError, RuntimeError, ValueError, KeyError):
        return None


def _note_gave_up(group: dist.ProcessGroup | None) -> None:
    """Tell the group's store that this rank gave up on a collective now (wall-clock time).

    A survivor whose own deadline comes later finds this rank exited; the note says it left
    after giving up, so the survivor blames the ranks still silent instead."""
    store = _store(group)
    if store is None:
        return
    try:
        store.set(GAVE_UP_KEY.format(rank=dist.get_rank(group)), repr(time.time()))
    except Exception:  # the store's host may be gone: then nobody learns, as before
        pass


def _gave_up(
    group: dist.ProcessGroup | None, ranks: list[int], timeout_s: float, grace_s: float = 0.0
) -> list[int]:
    """Those of `ranks` that noted giving up at a deadline within the last two deadlines, looking
    again for up to `grace_s` while none has (a peer's connection closes as it raises, a moment
    before its note is written)."""
    store = _store(group) if ranks else None
    if store is None:
        return []
    end = time.monotonic() + grace_s
    while True:
        recent = time.time() - 2 * timeout_s - 1.0
        left = []
        for r in ranks:
            key = GAVE_UP_KEY.format(rank=r)
            try:
                if store.check([key]) and float(store.get(key).decode()) >= recent:
                    left.append(r)
            except Exception:
                continue
        if left or time.monotonic() >= end:
            return left
        time.sleep(0.02)


def _reason(error: BaseException) -> str:
    """The backend's first line: whole when short, else up to its last sentence end within
    REASON_CHARS (never cut mid-word; a long line with no sentence end stays whole)."""
    text = str(error).strip()
    if not text:
        return type(error).__name__
    line = text.splitlines()[0]
    if len(line) <= REASON_CHARS:
        return line
    end = max(line.rfind(stop, 0, REASON_CHARS) for stop in (". ", "! ", "? "))
    return line[: end + 1] if end > 0 else line


def _timed_out(error: BaseException) -> bool:
    """Whether a backend failure is its deadline passing (not a broken connection)."""
    return "timed out" in str(error).lower()


def _timeout_error(
    group,
    timeout_s: float,
    phase: str,
    peers: PeerPids | None,
    error,
    names: tuple[int, ...] | None,
    watcher: DeathWatch | None,
) -> CommTimeoutError:
    """Name what can be proven: a stopped peer (it stalls every collective it is in, and a
    survivor that gave up on it and exited is not to blame), else a dead one, else nobody:
    the peers that did not arrive, with how the backend failed (deadline or lost connection)."""
    said = _reason(error)
    me = peers.rank if peers is not None else (dist.get_rank(group) if group is not None else 0)
    world = dist.get_world_size(group) if group is not None else 1
    named = names or tuple(range(world))
    timed_out = _timed_out(error)  # a deadline, not a broken connection: no grace
    stopped = [] if peers is None else peers.stopped()
    if stopped:
        stopped = [named[r] for r in stopped]
        ranks = ", ".join(map(str, stopped))
        detail = f"rank(s) {ranks} stopped (SIGSTOP or a debugger); torch.distributed: {said}"
        return CommTimeoutError(phase, stopped, timeout_s, [], detail)
    unordered = False
    if watcher is not None:
        dead, unordered = watcher.first_dead(0.0 if timed_out else DEATH_GRACE_S)
    else:
        dead = [] if peers is None else peers.dead() if timed_out else peers.dead_after_grace()
    left = _gave_up(group, dead, timeout_s)
    if left and len(left) == len(dead) < world - 1:  # survivors that gave up before this one: not to blame
        silent = [named[r] for r in range(world) if r != me and r not in left]
        ranks = ", ".join(str(named[r]) for r in left)
        detail = f"rank(s) {ranks} gave up waiting too, and left; torch.distributed: {said}"
        return CommTimeoutError(phase, silent, timeout_s, [], detail)
    dead = [r for r in dead if r not in left]
    if dead:
        time.sleep(LINGER_S)  # a slower survivor's first look must not find this rank exited too
        dead = [named[r] for r in dead]
        if unordered:  # one may be a survivor that gave up on the other and exited
            detail = f"all had exited when this rank first looked; torch.distributed: {said}"
            return CommTimeoutError(phase, dead, timeout_s, [], detail, lost=True)
        return CommTimeoutError(phase, dead, timeout_s, dead, f"torch.distributed: {said}")
    others = [r for r in range(world) if r != me]
    left = [] if timed_out else _gave_up(group, others, timeout_s, DEATH_GRACE_S)  # who left, if any?
    if left and len(left) < len(others):  # they left after their own deadline: so is this one
        silent = [named[r] for r in others if r not in left]
        ranks = ", ".join(str(named[r]) for r in left)
        detail = f"rank(s) {ranks} gave up waiting too, and left; torch.distributed: {said}"
        return CommTimeoutError(phase, silent, timeout_s, [], detail)
    detail = f"torch.distributed does not say which of them; it reported: {said}"
    return CommTimeoutError(phase, [named[r] for r in others], timeout_s, [], detail, lost=not timed_out)

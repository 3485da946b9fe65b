"""Waiting on peers: yield the CPU, keep a deadline, notice dead or aborted peers.

Tests run 8 ranks on 2 cores, so a wait never spins without yielding: it
starts with `sched_yield` (cheap when a core is free), then blocks on its
doorbell until a peer rings (see `ubep.doorbell`), or backs off to short
sleeps where there is no doorbell. Every wait has a deadline; on expiry it raises `CommTimeoutError` naming
the ranks that never signalled and the phase it was in.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ubep.errors import CommTimeoutError, UbepError
from ubep.timers import BlockTimes

YIELD_POLLS = 64  # polls answered with sched_yield before sleeping
MIN_SLEEP_S = 20e-6
MAX_SLEEP_S = 1e-3
LIVENESS_PERIOD_S = 0.05  # how often a long wait checks that its peers still run


@dataclass(frozen=True, slots=True)
class AbortNotice:
    """Why a peer gave up on a call; `culprit` is the rank it blames (None: itself),
    `cause` the transport's code for what the culprit did (passed on unchanged)."""

    reason: str
    culprit: int | None = None
    cause: int = 0


class PeerAbortedError(UbepError):
    """A peer gave up on the current call (bad input, its own failure, or a third
    rank's death or silence, named by `culprit`)."""

    def __init__(self, phase: str, peer: int, notice: AbortNotice):
        self.phase = phase
        self.peer = peer
        self.notice = notice
        self.culprit = notice.culprit
        super().__init__(f"{phase}: rank {peer} aborted the call ({notice.reason})")


def blame_of(error: UbepError) -> int | None:
    """The rank `error` blames, to pass on to the peers: its culprit, else the peer that aborted (None:
    no rank, e.g. a deadline)."""
    culprit = getattr(error, "culprit", None)
    if isinstance(error, PeerAbortedError) and culprit is None:
        culprit = error.peer
    return culprit


def rejected_input(phase: str, peer: int) -> PeerAbortedError:
    """`peer` rejected its own input for this call (a device half found it: see that rank's error)."""
    return PeerAbortedError(
        phase, peer, AbortNotice("it rejected its input for this call; see that rank's error")
    )


def pid_namespace() -> int:
    """Inode of this process's PID namespace (0 where /proc cannot tell)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def proc_is_ours() -> bool:
    """Whether /proc shows this process's PID namespace (not so after `unshare -p` without a new /proc)."""
    try:
        return os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        return False


def _stat(pid: str) -> tuple[bytes, int] | None:
    """(state letter, start in clock ticks after boot) of /proc/PID/stat; None: no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[19])


def start_time(pid: str) -> int | None:
    """Start time of process `pid` ("self": this one); None: no such process, or a zombie."""
    stat = _stat(pid)
    return None if stat is None or stat[0] in (b"Z", b"X") else stat[1]


@dataclass(frozen=True, slots=True)
class ProcessId:
    """A process as a peer can recognise it later: pid, PID-namespace inode and start time.

    A bare pid means nothing in another PID namespace (containers sharing a host) and
    names another process once reused; with the namespace and start time, `is_gone`
    and `is_stopped` answer True only where they can prove it, and False elsewhere
    (the caller's deadline then decides)."""

    pid: int
    pid_ns: int
    start: int

    @classmethod
    def this_process(cls) -> ProcessId:
        return cls(os.getpid(), pid_namespace(), start_time("self") or 0)

    def _judged_here(self) -> bool:
        return self.pid_ns == pid_namespace() and proc_is_ours()

    def is_gone(self) -> bool:
        """Provably exited: it ran in our PID namespace, and its pid is free, a zombie or a newer process."""
        return self._judged_here() and start_time(str(self.pid)) != self.start

    def is_stopped(self) -> bool:
        """Provably stopped (SIGSTOP, a debugger): it cannot take part in anything until resumed."""
        stat = _stat(str(self.pid)) if self._judged_here() else None
        return stat is not None and stat[1] == self.start and stat[0] in (b"T", b"t")


class Waiter:
    """One wait of one phase: call `pause(pending)` while peers in `pending` are not ready.

    `peer_gone(r)` says whether peer r's process provably exited (False where that
    cannot be known: no liveness check); `peer_abort(r)` returns a notice when peer r has aborted this call;
    `block(timeout_s)`, when given, sleeps until a peer signals (a doorbell)
    instead of sleeping for a fixed interval; `on_fail(error)` runs just before
    the wait raises (to tell the other peers); the first `yields` pauses only yield the CPU;
    `times` (the call's timers, when on: `ubep.timers`) counts the yields and sleeps.
    """

    def __init__(
        self,
        phase: str,
        timeout_s: float,
        peer_gone: Callable[[int], bool],
        peer_abort: Callable[[int], AbortNotice | None],
        block: Callable[[float], None] | None = None,
        on_fail: Callable[[UbepError], None] | None = None,
        yields: int = YIELD_POLLS,
        times: BlockTimes | None = None,
    ):
        self.phase = phase
        self.timeout_s = timeout_s
        self._peer_gone = peer_gone
        self._peer_abort = peer_abort
        self._block = block
        self._on_fail = on_fail
        self._start = time.monotonic()
        self._deadline = self._start + timeout_s
        # a deadline shorter than the liveness period is looked at when it passes, not a period later
        self._next_check = min(self._start + LIVENESS_PERIOD_S, self._deadline)
        self._polls = 0
        self._yields = yields
        self._times = times

    def pause(self, pending: Iterable[int]) -> None:
        """Yield once; raise if the deadline passed or a pending peer died or aborted."""
        self._polls += 1
        if self._polls <= self._yields:
            os.sched_yield()
            if self._times is not None:
                self._times.yields += 1
            return
        if self._times is not None:
            self._times.sleeps += 1
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = min(now + LIVENESS_PERIOD_S, self._deadline)
            self._check(list(pending), now)
        if self._block is not None:
            self._block(self._next_check - now)
        else:
            time.sleep(min(MAX_SLEEP_S, MIN_SLEEP_S * 2 ** min(self._polls - self._yields, 6)))

    def _check(self, pending: list[int], now: float) -> None:
        error: UbepError | None = None
        for peer in pending:  # a peer that gave up on its own beats one that passes its blame on
            notice = self._peer_abort(peer)
            if notice is not None and (error is None or notice.culprit is None):
                error = PeerAbortedError(self.phase, peer, notice)
                if notice.culprit is None:
                    break
        if error is None:
            dead = [p for p in pending if self._peer_gone(p)]
            if dead or now >= self._deadline:
                error = CommTimeoutError(self.phase, pending, self.timeout_s, dead)
        if error is not None:
            if self._on_fail is not None:
                self._on_fail(error)
            raise error

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


def process_alive(pid: int) -> bool:
    """Whether `pid` runs on this host (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in (b"Z", b"X")


class Waiter:
    """One wait of one phase: call `pause(pending)` while peers in `pending` are not ready.

    `peer_pid(r)` gives a local peer's process id (None if unknown: no liveness
    check); `peer_abort(r)` returns a notice when peer r has aborted this call;
    `block(timeout_s)`, when given, sleeps until a peer signals (a doorbell)
    instead of sleeping for a fixed interval; `on_fail(error)` runs just before
    the wait raises (to tell the other peers).
    """

    def __init__(
        self,
        phase: str,
        timeout_s: float,
        peer_pid: Callable[[int], int | None],
        peer_abort: Callable[[int], AbortNotice | None],
        block: Callable[[float], None] | None = None,
        on_fail: Callable[[UbepError], None] | None = None,
    ):
        self.phase = phase
        self.timeout_s = timeout_s
        self._peer_pid = peer_pid
        self._peer_abort = peer_abort
        self._block = block
        self._on_fail = on_fail
        self._start = time.monotonic()
        self._next_check = self._start + LIVENESS_PERIOD_S
        self._polls = 0

    def pause(self, pending: Iterable[int]) -> None:
        """Yield once; raise if the deadline passed or a pending peer died or aborted."""
        self._polls += 1
        if self._polls <= YIELD_POLLS:
            os.sched_yield()
            return
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + LIVENESS_PERIOD_S
            self._check(list(pending), now)
        if self._block is not None:
            self._block(self._next_check - now)
        else:
            time.sleep(min(MAX_SLEEP_S, MIN_SLEEP_S * 2 ** min(self._polls - YIELD_POLLS, 6)))

    def _check(self, pending: list[int], now: float) -> None:
        error: UbepError | None = None
        for peer in pending:
            notice = self._peer_abort(peer)
            if notice is not None:
                error = PeerAbortedError(self.phase, peer, notice)
                break
        if error is None:
            dead = [p for p in pending if (pid := self._peer_pid(p)) is not None and not process_alive(pid)]
            if dead or now - self._start >= self.timeout_s:
                error = CommTimeoutError(self.phase, pending, self.timeout_s, dead)
        if error is not None:
            if self._on_fail is not None:
                self._on_fail(error)
            raise error

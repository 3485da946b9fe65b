"""Timing many ranks fairly: a common start instant, the slowest rank's finish.

A barrier releases ranks at different moments (hundreds of microseconds apart
when 8 ranks share 2 cores), which would charge the skew to the system under
test. Instead rank 0 names a start instant a little in the future on the
host's monotonic clock (shared by all processes); every rank waits for it,
runs the operation, and records its finish. An iteration lasts from the start
instant to the last rank's finish.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

LEAD_S = 0.003  # how far ahead rank 0 sets the start instant


def wait_until(instant: float) -> None:
    """Sleep most of the way, then yield until `instant` (monotonic seconds)."""
    remaining = instant - time.monotonic()
    if remaining > 0.001:
        time.sleep(remaining - 0.001)
    while time.monotonic() < instant:
        os.sched_yield()


def timed(op: Callable[[], object], start: float) -> float:
    """Run `op` from the common start instant; return this rank's finish time."""
    wait_until(start)
    op()
    return time.monotonic()


def latencies_us(starts: list[float], finishes_per_rank: list[list[float]]) -> list[float]:
    """Per iteration, in microseconds: the slowest rank's finish minus the common start."""
    return [(max(f[i] for f in finishes_per_rank) - s) * 1e6 for i, s in enumerate(starts)]


@dataclass(frozen=True, slots=True)
class Stats:
    median_us: float
    p99_us: float

    @classmethod
    def of(cls, latencies_us: list[float]) -> Stats:
        ordered = sorted(latencies_us)
        p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
        return cls(statistics.median(ordered), p99)

"""Call timers: where a call's time goes, without a profiler's inflation.

A Buffer built with `call_timers=True` (or UBEP_CALL_TIMERS=1) keeps one `BlockTimes` per kind of
call ("dispatch", "combine", "ll_dispatch", "ll_combine"); every `CallId` of that kind carries it
down (`CallId.timers`), and
each layer marks the end of the block it just ran with `lap(block)`, which charges the wall and
CPU time since the previous mark to that block. The blocks therefore partition a call:

    validate  the Buffer's checks and send plan, up to the exchange
    between   Python in the exchange outside the blocks below (outputs allocated, plans, arguments)
    send      the compiled send half (its arguments' numpy views included; a low-latency one's
              reuse wait too), and the rings of the peers it found asleep; across hosts, the
              messages to the peers (filled and sent), or a collective of hier-bsp's rails (it
              sends and waits in one call)
    forward   across hosts, hierarchical only: rows on their way through the node (a rail peer's
              rows and this rank's own into its forward set; the combine's puts to the forwarders,
              and each forwarder's sum over its node)
    receive   entries of the compiled receive halves, re-entries after a sleep included (their own
              spin and yield polls are inside them); across hosts, a landed message's rows taken
              into place (or added, in a combine), and hier's fan out (this rank's rows pulled from
              every forward set)
    wait      sleeping on the doorbell between entries (`Heap.sleeper`), with its peer checks;
              across hosts, waiting for a peer's message in the fabric (`timed`) or a node peer's
              stamp in the heap
    results   the handle, the expert counts and the result tuple

The counts per call: receive-half entries, doorbell sleeps, rings sent to sleeping peers, yields
in Python waits (a compiled half's own yields are not seen from here), and the thread's voluntary
(blocking) and involuntary (preempted, or a sched_yield that gave the core away) context switches.
Off (the default) nothing is timed: `CallId.timers` is None and each site tests only that.

The marks sit on protocol ubep's compiled (numba) path, low-latency mode's, and the exchanges
across hosts over the fabric (`ubep.across`: flat, low-latency, hierarchical) and hier-bsp's; on
other paths what is not marked (a bsp send half, the torch or Triton halves, bsp-gloo's
collectives) falls in "between", and the receive entries of any half entered through
`ubep.protocols.halves.run` in "receive". A low-latency receive half run later (its hook, or
event.wait()) is charged from where it starts (`BlockTimes.resume`), not from the call's return.
CPU time is this thread's (`time.thread_time_ns`): the compiled halves run in the calling thread;
mover threads (workers > 1) and an engine's own I/O threads (gloo's) are not counted.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

TIMED_KINDS = ("dispatch", "combine", "ll_dispatch", "ll_combine")
BLOCKS = ("validate", "between", "send", "forward", "receive", "wait", "results")
COUNTS = ("entries", "sleeps", "rings", "yields", "switches_voluntary", "switches_involuntary")


@dataclass(slots=True)
class BlockTimes:
    """Wall and CPU nanoseconds per block, and event counts, summed over the calls of one kind."""

    calls: int = 0
    wall_ns: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BLOCKS, 0))
    cpu_ns: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BLOCKS, 0))
    entries: int = 0
    sleeps: int = 0
    rings: int = 0
    yields: int = 0
    switches_voluntary: int = 0
    switches_involuntary: int = 0
    _wall: int = 0  # the latest mark
    _cpu: int = 0
    _switches: tuple[int, int] = (0, 0)  # the thread's context switches at the call's start

    def begin(self) -> BlockTimes:
        """A call of this kind starts: count it and set the first mark."""
        self.calls += 1
        usage = resource.getrusage(resource.RUSAGE_THREAD)
        self._switches = (usage.ru_nvcsw, usage.ru_nivcsw)
        self._wall, self._cpu = time.perf_counter_ns(), time.thread_time_ns()
        return self

    def resume(self) -> None:
        """A receive half run later (a hook) starts: mark now, so the caller's time since the call
        returned is charged to no block."""
        self._wall, self._cpu = time.perf_counter_ns(), time.thread_time_ns()

    def lap(self, block: str) -> None:
        """Charge the time since the previous mark to `block` (one of BLOCKS) and mark now."""
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        self.wall_ns[block] += wall - self._wall
        self.cpu_ns[block] += cpu - self._cpu
        self._wall, self._cpu = wall, cpu

    def end(self) -> None:
        """The call returns: the time since the last mark is its results'; count its context switches."""
        self.lap("results")
        usage = resource.getrusage(resource.RUSAGE_THREAD)
        self.switches_voluntary += usage.ru_nvcsw - self._switches[0]
        self.switches_involuntary += usage.ru_nivcsw - self._switches[1]

    def per_call(self) -> dict[str, float]:
        """Microseconds per call of each block's wall ("wall <block>") and CPU ("cpu <block>"), and
        each of COUNTS per call; empty before the first call."""
        if not self.calls:
            return {}
        out = {f"wall {b}": self.wall_ns[b] / self.calls / 1e3 for b in BLOCKS}
        out |= {f"cpu {b}": self.cpu_ns[b] / self.calls / 1e3 for b in BLOCKS}
        return out | {c: getattr(self, c) / self.calls for c in COUNTS}


Item = TypeVar("Item")


def lap(times: BlockTimes | None, block: str) -> None:
    """`times.lap(block)` where the call is timed; nothing where it is not (`times` None)."""
    if times is not None:
        times.lap(block)


def timed(items: Iterable[Item], times: BlockTimes | None, block: str = "wait") -> Iterator[Item]:
    """Each of `items` (a wait's arrivals), the time spent getting it charged to `block`: the caller
    laps its own work on each item (so that work is not charged here at the next one)."""
    if times is None:
        yield from items
        return
    for item in items:
        times.lap(block)
        yield item
    times.lap(block)  # the last look, after the last item


class CallTimers:
    """A Buffer's call timers: one `BlockTimes` per timed kind of call (see the module's doc)."""

    def __init__(self) -> None:
        self.kinds = {kind: BlockTimes() for kind in TIMED_KINDS}

    def begin(self, kind: str) -> BlockTimes | None:
        """The times of a call of `kind` that starts now, or None for a kind not timed."""
        times = self.kinds.get(kind)
        return None if times is None else times.begin()

    def reset(self) -> None:
        """Forget every call so far (after warm-up calls, say)."""
        self.kinds = {kind: BlockTimes() for kind in TIMED_KINDS}

    def per_call(self) -> dict[str, dict[str, float]]:
        """`BlockTimes.per_call` of each timed kind."""
        return {kind: times.per_call() for kind, times in self.kinds.items()}

"""Taking turns: one system runs at a time, round by round, across the bench's process groups.

    conductor (the bench's parent)           group "launch" (ubep, bsp-*, floor)   group "mpi"
    round 0:  go ubep   --one byte per rank-->  dispatch + combine, timed
              <------------ one byte per rank --  done
              go mpi    ------------------------------------------------------>  dispatch + combine
              ...
    round 1:  the same systems, the order rotated by one
    end:      QUIT      -> every group returns its per-round samples

On a shared host the load drifts over seconds. Timing each system's iterations
in one block lets that drift pass for a difference between systems; taking
turns round by round gives every system the same stretch of time, and round i
of one system can be set beside round i of another (see `ratio`).

Each group has a directory of named pipes: `go.<rank>` carries one byte per
turn to that rank (the index of the system in ROWS, or QUIT), and `done`
one byte per rank back (also once after setup: ready). The conductor writes
the next turn only after every rank of the group has answered. A waiting rank
sleeps in the kernel: the group whose turn it is has the host's cores to itself.
During setup, the group's rank 0 names each system it has opened and checked on
`progress`, one line each, so the bench can say which rows are ready while the
slowest (the MPI job's start-up) is still coming.
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple

from ubep.bench.timing import timed
from ubep.bench.workload import ROWS

QUIT = 255
POLL_S = 0.1  # how often the conductor looks at a group that is slow to answer


def round_order(systems: tuple[str, ...], rounds: int) -> list[tuple[str, ...]]:
    """The systems in the order each round runs them: round i starts i places further on.

    ("a", "b", "c") over 4 rounds: abc, bca, cab, abc. Every system runs once a
    round and, over len(systems) rounds, once in every position, so no system
    always follows the same neighbour or always runs first after a pause.
    """
    n = len(systems)
    return [systems[i % n :] + systems[: i % n] for i in range(rounds)]


class Calls(NamedTuple):
    """One system's two timed operations on this rank, ready to run (already verified)."""

    dispatch: Callable[[], object]
    combine: Callable[[], object]


Samples = dict[str, dict[str, tuple[list[float], list[float]]]]  # system -> op -> (starts, finishes)


class Turns:
    """A rank's end of its group's pipes."""

    def __init__(self, directory: str, rank: int, timeout_s: float):
        # O_RDWR: opening a pipe does not wait for the other end, and a reader never sees EOF.
        self._go = os.open(os.path.join(directory, f"go.{rank}"), os.O_RDWR)
        self._done = os.open(os.path.join(directory, "done"), os.O_RDWR)
        self._progress = os.open(os.path.join(directory, "progress"), os.O_RDWR)
        self._timeout_s = timeout_s

    def answer(self) -> None:
        os.write(self._done, b"\x01")

    def opened(self, system: str) -> None:
        """Tell the bench that `system` is open and checked (rank 0 speaks for its group)."""
        os.write(self._progress, f"{system}\n".encode())

    def next(self) -> str | None:
        """The system whose turn it is, or None when the conductor says QUIT."""
        readable, _, _ = select.select([self._go], [], [], self._timeout_s)
        if not readable:
            raise TimeoutError(f"no turn from the bench for {self._timeout_s:g} s")
        (code,) = os.read(self._go, 1)
        return None if code == QUIT else ROWS[code]

    def close(self) -> None:
        os.close(self._go)
        os.close(self._done)
        os.close(self._progress)


def take_turns(turns: Turns, calls: dict[str, Calls], start: Callable[[], float]) -> Samples:
    """Say ready, then time each turn's dispatch and combine (from `start()`'s instant) until QUIT."""
    samples: Samples = {name: {"dispatch": ([], []), "combine": ([], [])} for name in calls}
    turns.answer()
    while (name := turns.next()) is not None:
        for op, call in zip(("dispatch", "combine"), calls[name], strict=True):
            starts, finishes = samples[name][op]
            starts.append(start())
            finishes.append(timed(call, starts[-1]))
        turns.answer()
    return samples


class Conductor:
    """The parent's end: a directory of pipes per group, and the turns.

    `check` callables raise the group's own error when it has ended; the
    conductor calls them while it waits, so a group that dies is reported as
    itself rather than as a silent timeout.
    """

    def __init__(self, root: str, sizes: dict[str, int], timeout_s: float):
        self._root = root
        self._timeout_s = timeout_s
        self._go: dict[str, list[int]] = {}  # one pipe per rank
        self._done: dict[str, int] = {}
        self._progress: dict[str, int] = {}
        for group, size in sizes.items():
            os.mkdir(self.directory(group))
            self._go[group] = [self._pipe(group, f"go.{rank}") for rank in range(size)]
            self._done[group] = self._pipe(group, "done")
            self._progress[group] = self._pipe(group, "progress")

    def directory(self, group: str) -> str:
        return os.path.join(self._root, group)

    def _pipe(self, group: str, name: str) -> int:
        path = os.path.join(self.directory(group), name)
        os.mkfifo(path, 0o600)
        return os.open(path, os.O_RDWR)

    def ready(
        self, checks: Mapping[str, Callable[[], None]], opened: Callable[[str], None] = lambda system: None
    ) -> None:
        """Wait until every rank of every group in `checks` (group -> its check) has set up and
        verified its systems, all groups at once; `opened(system)` hears each system as a group's
        rank 0 reports it open and checked."""
        missing = {group: len(self._go[group]) for group in checks}
        said = {self._progress[g]: g for g in checks}
        partial = dict.fromkeys(checks, b"")  # a line's start, where a read ended inside it

        def hear(fds: list[int]) -> None:
            for fd in fds:
                *lines, partial[said[fd]] = (partial[said[fd]] + os.read(fd, 4096)).split(b"\n")
                for line in lines:
                    opened(line.decode())

        deadline = time.monotonic() + self._timeout_s
        while any(missing.values()):
            answers = {self._done[g]: g for g in checks if missing[g]}
            readable, _, _ = select.select([*said, *answers], [], [], POLL_S)
            hear([fd for fd in readable if fd in said])  # first: rank 0 says before it answers
            for fd in [fd for fd in readable if fd in answers]:
                missing[answers[fd]] -= len(os.read(fd, missing[answers[fd]]))
            if readable:
                continue
            for group in [g for g in checks if missing[g]]:
                checks[group]()
            if time.monotonic() > deadline:
                late = ", ".join(f"{n} rank(s) of {g}" for g, n in missing.items() if n)
                raise TimeoutError(f"{late} not set up after {self._timeout_s:g} s")
        # The last answer can come in the read that a select woke for an earlier one, before the
        # line its rank wrote first was heard: every line is in its pipe by now.
        while readable := select.select(list(said), [], [], 0)[0]:
            hear(readable)

    def turn(self, group: str, system: str, check: Callable[[], None]) -> None:
        """One turn: every rank of `group` times `system` once; returns when all have answered."""
        self._send(group, ROWS.index(system))
        self._answers(group, check)

    def quit(self, group: str) -> None:
        self._send(group, QUIT)

    def close(self) -> None:
        for fd in [fd for fds in self._go.values() for fd in fds] + [
            *self._done.values(),
            *self._progress.values(),
        ]:
            os.close(fd)
        self._go.clear()
        self._done.clear()
        self._progress.clear()

    def _send(self, group: str, code: int) -> None:
        for fd in self._go[group]:
            os.write(fd, bytes([code]))

    def _answers(self, group: str, check: Callable[[], None]) -> None:
        done_fd, missing = self._done[group], len(self._go[group])
        deadline = time.monotonic() + self._timeout_s
        while missing:
            readable, _, _ = select.select([done_fd], [], [], POLL_S)
            if readable:
                missing -= len(os.read(done_fd, missing))
                continue
            check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{missing} rank(s) of {group} silent for {self._timeout_s:g} s")

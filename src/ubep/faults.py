"""Fault injection for tests: kill, delay or corrupt one rank at a named point.

A `FaultPlan` is a frozen value passed to `Buffer(..., faults=plan)`; it never
lives in a global or an environment variable. The Buffer binds it to its rank
as `FaultPoints`, and the protocols call that object at their named points:

    faults.at("dispatch.sent", call)            # maybe kill or delay here
    n = faults.count("dispatch.count", call, n)  # maybe publish a wrong count

Without a plan (or on other ranks) both are one attribute test and a return.

Fault points, in the order a dispatch/combine pair passes them:
    dispatch.start   after input checks, before this rank publishes anything
    dispatch.count   the token count this rank publishes (action "corrupt" only)
    dispatch.sent    this rank's tokens are out; it has not received yet
    dispatch.end     dispatch returned (between dispatch and combine)
    combine.start    before this rank sends any combine rows
    combine.mid      after it sent rows to one peer, before the others (shm protocols)
    ll_combine.put   a low-latency combine put its rows into one home and checked its membership;
                     the next home's rows are not put yet (shared heap: the window between a
                     writer's check and its put, where action "stop" freezes it)

Action "cut" (the fabric, zmq engine) is a link down rather than a process fault: from its point on,
nothing this rank sends over the fabric reaches `peers`. Given to every rank of both sides, naming
the other side, it splits the group in two with every process alive (a partition).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from ubep.calls import CallId

POINTS = (
    "dispatch.start",
    "dispatch.count",
    "dispatch.sent",
    "dispatch.end",
    "combine.start",
    "combine.mid",
    "ll_combine.put",
)
ACTIONS = ("kill", "delay", "corrupt", "stop", "cut")
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True)
class FaultPlan:
    """One fault: on `rank`, when call number `call` (1-based, counting every
    dispatch and combine) reaches `point`, do `action`.

    kill:    SIGKILL this process (no cleanup, no goodbye), like an OOM kill.
    delay:   sleep `delay_s` seconds, then carry on (a straggler, or a stall).
    stop:    SIGSTOP this process: it runs on when someone sends SIGCONT (preemption, a
             debugger, a cgroup freeze), not knowing what its peers did meanwhile.
    corrupt: publish `value` instead of the true count (only at "dispatch.count").
    cut:     from then on, drop every message and abort notice this rank sends over the fabric to
             `peers` (its link to them is down; both sides go on running).
    """

    rank: int
    point: str
    action: str
    call: int = 1
    delay_s: float = 0.0
    value: int = -1
    peers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.point not in POINTS:
            raise ValueError(f"FaultPlan.point must be one of {POINTS}, got {self.point!r}")
        if self.action not in ACTIONS:
            raise ValueError(f"FaultPlan.action must be one of {ACTIONS}, got {self.action!r}")
        if (self.action == "corrupt") != (self.point == "dispatch.count"):
            raise ValueError("FaultPlan: action 'corrupt' goes with point 'dispatch.count', and only it")
        if (self.action == "cut") != bool(self.peers):
            raise ValueError("FaultPlan: action 'cut' needs the peers it cuts off, and only it takes peers")
        if self.call < 1 or self.rank < 0 or self.delay_s < 0:
            raise ValueError("FaultPlan: call must be >= 1, rank and delay_s >= 0")


class FaultPoints:
    """The hooks one rank's protocols call; inert unless the plan targets this rank."""

    __slots__ = ("_plan", "armed", "cut")

    def __init__(self, plan: FaultPlan | None = None, rank: int = 0):
        self._plan = plan if plan is not None and plan.rank == rank else None
        self.armed = self._plan is not None  # hot paths test this before calling `at`
        self.cut: frozenset[int] = frozenset()  # peers the fabric no longer reaches (action "cut")

    def _due(self, point: str, call: CallId) -> FaultPlan | None:
        plan = self._plan
        if plan is None or plan.point != point or plan.call != call.seq:
            return None
        return plan

    def at(self, point: str, call: CallId) -> None:
        """Fault point `point` of `call`: fire the plan's kill or delay if it is due."""
        if self._plan is None:
            return
        plan = self._due(point, call)
        if plan is None:
            return
        if plan.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif plan.action == "delay":
            time.sleep(plan.delay_s)
        elif plan.action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif plan.action == "cut":
            self.cut = frozenset(plan.peers)

    def count(self, point: str, call: CallId, value: T) -> T | int:
        """The count(s) to publish at `point`: `value`, or the plan's corrupt one when due."""
        if self._plan is None:
            return value
        plan = self._due(point, call)
        return value if plan is None else plan.value


NO_FAULTS = FaultPoints()

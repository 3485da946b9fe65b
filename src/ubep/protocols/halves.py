"""Entering a compiled call half: run it until it is no longer waiting, sleeping on the doorbell between.

Every compiled half that waits (`numba_halves` of `ubep.protocols.ubep`, `.bsp` and `.ll`) takes, last,
(pending, spins, yields, status) and returns DONE, WAITING (status[1] ranks in
pending still missing, this rank's ASLEEP word armed) or an error code. Between
entries the heap's sleeper waits on the doorbell under the deadline and raises
CommTimeoutError or PeerAbortedError naming the missing peers, as every other
wait does; the half then resumes from its own state.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from typing import TypeVar

import numpy as np

from ubep.calls import CallId
from ubep.engine.base import Engine
from ubep.protocols.base import Agreement, Exchange
from ubep.registry import ENGINES
from ubep.transport.heap import Heap
from ubep.waiting import YIELD_POLLS

DONE, WAITING = 0, 1  # the codes every compiled half shares
MASKED = -1  # a send half stopped after a block: the peers masked this rank (`numba_sync.masked_by`)
# Polls with the spin-wait hint before a half yields its core: few where ranks outnumber cores (a
# spinning rank would hold the core its peer needs), many where each rank has a core of its own
# (a sleep and its wake-up cost tens of microseconds). Chosen from the sweep in docs/benchmarks-log.md
# ("Waiting, rings and the combine reduction"): no yields, or long spins with ranks sharing cores, are slower.
SPIN_POLLS_SHARED, SPIN_POLLS_ALONE = 256, 16384


def budget(ranks_here: int) -> tuple[int, int]:
    """(spins, yields) a half takes before handing its wait to Python, for `ranks_here` ranks
    on this host's usable cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return (SPIN_POLLS_ALONE if ranks_here <= cores else SPIN_POLLS_SHARED), YIELD_POLLS


H = TypeVar("H")


def compiled_form(engine: Engine, on_numba: Callable[[], H], on_triton: Callable[[], H]) -> H | None:
    """A protocol's call halves as one compiled function each, in the form `engine` runs: built by
    `on_numba` where it compiles CPU code (`EngineSpec.compiled`), by `on_triton` where it launches
    device kernels (`EngineSpec.device_kernels`), else None (the torch statement, step by step).

    Each form is a function, called only on its engine: building one imports numba or triton. The
    caller decides whether its memory allows compiled halves at all (a heap's address table)."""
    spec = ENGINES[engine.name]
    if spec.compiled:
        return on_numba()
    if spec.device_kernels:
        return on_triton()
    return None


def describe(compiled, engine) -> str:
    """How a protocol's call halves run, in words (for `Buffer.explain`): `compiled` is its compiled
    halves or None."""
    if compiled is None:
        return "step by step in Python"
    if ENGINES[engine.name].device_kernels:
        return (
            "one Triton kernel launch each"
            + (" (the interpreter, on the CPU)" if compiled.device.type == "cpu" else "")
            + (", capturable: no host read, errors at check()" if compiled.capturable else "")
        )
    return "compiled"


def refuse_capturable(capturable: bool, compiled, protocol: str) -> None:
    """A capturable normal-mode exchange needs the Triton halves: refuse any other, saying why."""
    if capturable and (compiled is None or not compiled.layout_by_send):
        raise ValueError(
            f"capturable=True: normal mode ({protocol}) needs its Triton halves (engine 'triton' on a heap: "
            "transport 'shm', 'virtual' or 'cuda', workers=1)"
        )


class OnHalves(Exchange):
    """A normal-mode exchange on a heap, answering the Buffer's questions from its compiled halves
    (`_compiled`: numba or Triton, or None where the torch statement runs)."""

    _compiled = None
    engine = None

    @property
    def halves(self) -> str:
        """How each call half runs here, in words (for `Buffer.explain`)."""
        return describe(self._compiled, self.engine)

    @property
    def layout_by_send(self) -> bool:
        """Whether the send half derives the layout from topk_idx and checks its values itself (the
        Triton halves), so that the Buffer reads none of them on the host (`SendPlan.layout_by_send`)."""
        return self._compiled is not None and self._compiled.layout_by_send

    def check(self) -> None:
        """Capturable halves: raise the first error their status words recorded since the last check."""
        if self._compiled is not None:
            self._compiled.check()

    # -- membership: the heap's (a rank masked, its rows left out, a restarted rank taken back in) --

    def mask(self, ranks: Collection[int], seq: int) -> int:
        return self.t.mask(ranks, seq)

    def agree_to_mask(self, error: Exception, seq: int) -> Agreement | None:
        return self.t.agree_to_mask(error, seq)

    def agree(self, value: int, phase: str) -> dict[int, int]:
        return self.t.agree(value, phase)

    def admissions(self, seq: int, boundary: bool) -> frozenset[int]:
        return self.t.admissions(seq, boundary)

    def admit(self, ranks: Collection[int], seq: int) -> frozenset[int]:
        return self.t.admit(ranks, seq)

    def join(self, deadline_s: float, stamp: Callable[[str], None]) -> Agreement:
        return self.t.join(deadline_s, stamp)


def run(heap: Heap, call: CallId, phase: str, half, *args, block: str = "receive") -> int:
    """Enter `half(*args)` until it stops waiting; returns DONE or its error code (details in status).
    With call timers on, its entries are charged to `block` ("send" for a send half that waits)."""
    times = call.timers
    if times is not None:
        times.lap("between")
        times.entries += 1
    code = half(*args)
    if times is not None:
        times.lap(block)
    return code if code != WAITING else resume(heap, call, phase, half, *args, block=block)


def resume(heap: Heap, call: CallId, phase: str, half, *args, block: str = "receive") -> int:
    """A half returned WAITING: sleep on the doorbell, enter again, until it stops waiting."""
    pending, status = args[-4], args[-1]
    sleeper = heap.sleeper(phase, call)
    times, code = call.timers, WAITING
    while code == WAITING:
        sleeper.pause(pending[: status[1]].tolist())
        if times is not None:
            times.lap("wait")
            times.entries += 1
        code = half(*args)
        if times is not None:
            times.lap(block)
    return code


class HeapHalves:
    """What every protocol on compiled halves keeps for one Buffer: the address table of its blocks,
    the ASLEEP words, the marks of peers to ring, and the wait budget of this host."""

    layout_by_send = False  # the Buffer derives the layout on the host (only Triton halves do it in a kernel)

    def __init__(self, heap: Heap, blocks):
        self.t, self.blocks = heap, blocks
        self.me, self.R = heap.rank, heap.num_ranks
        self.table, self.asleep = heap.address_table(blocks.table())
        self.wake = np.zeros(self.R, dtype=np.uint8)  # peers a half found asleep, to ring
        self.budget = budget(self.R)  # every rank of a heap runs on this host
        self.members = heap.members_at()  # every rank's membership records, for a writer's check

    def check(self) -> None:
        """Nothing to raise later: a compiled half's error comes back with its call."""

    def sent(self, woken: int, phase: str) -> None:
        """After a send half that returned `woken` != 0: ring the peers it marked; if it stopped
        because the peers masked this rank (MASKED), raise MaskedOutError in the Python check's words."""
        self.t.ring_marked(self.wake)
        if woken == MASKED:
            self.t.check_member(phase)
            raise RuntimeError(f"{phase}: the peers masked this rank")  # check_member raised already

    def _memory(self, call: CallId) -> tuple:
        """What every half takes first: (table, asleep, this rank, epoch, half, live ranks)."""
        return self.table, self.asleep, self.me, call.epoch, call.epoch & 1, self.t.live_R

"""Entering a compiled call half: run it until it is no longer waiting, sleeping on the doorbell between.

Every compiled half (`ubep.engine.ubep_halves`, `ubep.engine.ll_halves`) takes, last,
(pending, spins, yields, status) and returns DONE, WAITING (status[1] ranks in
pending still missing, this rank's ASLEEP word armed) or an error code. Between
entries the heap's sleeper waits on the doorbell under the deadline and raises
CommTimeoutError or PeerAbortedError naming the missing peers, as every other
wait does; the half then resumes from its own state.
"""

from __future__ import annotations

import numpy as np

from ubep.calls import CallId
from ubep.transport.heap import Heap
from ubep.waiting import YIELD_POLLS

DONE, WAITING = 0, 1  # the codes every compiled half shares
SPIN_POLLS = 256  # polls with the spin-wait hint before a half starts yielding its core
BUDGET = (SPIN_POLLS, YIELD_POLLS)  # (spins, yields) a half takes before handing its wait to Python


def status_words(num_ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """(pending int64 [R], status int64 [6]): the scratch every waiting half writes."""
    return np.empty(num_ranks, dtype=np.int64), np.zeros(6, dtype=np.int64)


def run(heap: Heap, call: CallId, phase: str, half, *args) -> int:
    """Enter `half(*args)` until it stops waiting; returns DONE or its error code (details in status)."""
    code = half(*args)
    return code if code != WAITING else resume(heap, call, phase, half, *args)


def resume(heap: Heap, call: CallId, phase: str, half, *args) -> int:
    """A half returned WAITING: sleep on the doorbell, enter again, until it stops waiting."""
    pending, status = args[-4], args[-1]
    sleeper = heap.sleeper(phase, call)
    code = WAITING
    while code == WAITING:
        sleeper.pause(pending[: status[1]].tolist())
        code = half(*args)
    return code

"""What the writers' membership check costs (docs/reliability.md, "A masked rank that wakes").

    python scripts/membership_cost.py [--ranks 8,16,64] [--reps 9]

Every compiled send half calls `masked_by` after each block it puts into a peer's memory: R
blocks a half, each check reading two record words of every live peer. This times those R
checks over real membership records (none masking the writer, the common case), in one numba
loop, against the same loop calling a function that returns at once, so the figure is the
checks alone. Medians over repetitions; nanoseconds per check and microseconds per send half.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy as np

from ubep.engine.numba_sync import masked_by


@numba.njit(cache=True, nogil=True)
def _nothing(members, live, me, generation):
    return -1


@numba.njit(cache=True, nogil=True)
def _half(check, members, live, me, generation, blocks):
    """One send half's checks: one after each of `blocks` blocks."""
    found = 0
    for _ in range(blocks):
        found += check(members, live, me, generation)
    return found


def _records(R: int) -> tuple[np.ndarray, np.ndarray]:
    """(words keeping each rank's two membership records alive, their addresses int64 [R])."""
    words = 2 + R
    memory = np.zeros((R, 2 * words), dtype=np.int64)
    memory[:, 0] = 1  # generation 1, no rank masked
    return memory, memory[:, 0].ctypes.data + np.arange(R, dtype=np.int64) * memory.strides[0]


def _time(check, members, live, halves: int, R: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(halves):
        _half(check, members, live, 0, 0, R)
    return (time.perf_counter_ns() - start) / halves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="8,16,64")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--halves", type=int, default=2000)
    args = parser.parse_args()
    print(f"{'ranks':>5} {'ns/check':>9} {'us/half':>8}  (R checks of R peers a half; median of {args.reps})")
    for R in (int(r) for r in args.ranks.split(",")):
        memory, members = _records(R)
        live = np.arange(R, dtype=np.int64)
        _time(masked_by, members, live, 10, R), _time(_nothing, members, live, 10, R)  # compile
        costs = [
            _time(masked_by, members, live, args.halves, R) - _time(_nothing, members, live, args.halves, R)
            for _ in range(args.reps)
        ]
        per_half = statistics.median(costs)
        print(f"{R:>5} {per_half / R:>9.1f} {per_half / 1e3:>8.2f}")
        del memory


if __name__ == "__main__":
    main()

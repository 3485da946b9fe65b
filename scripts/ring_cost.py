"""What one doorbell ring costs the ringing rank: its CPU for `Doorbell.ring` when the peer sleeps on
its doorbell (the ring wakes it) and when the peer is busy (the datagram only queues).

    python scripts/ring_cost.py [--rings 2000]

Two processes, as two ranks of a heap: the sleeper blocks in `Doorbell.wait`, or spins without
reading its doorbell; the ringer rings once every 200 us (so a sleeper has gone back to sleep) and
times each `ring` with `time.thread_time_ns` (its own CPU: the sendto and, for a sleeper, the
kernel's wake-up done in the ringer's context). Run with the host otherwise idle; the printout
gives medians and the 90th percentile in microseconds (docs/benchmarks-log.md, "Waiting").
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

from ubep.doorbell import Doorbell

NAMES = [f"ubep-ring-cost-{os.getpid()}-{r}" for r in (0, 1)]


def sleeper(mode: str, stop) -> None:
    bell = Doorbell(NAMES[1])
    while not stop.is_set():
        if mode == "asleep":
            bell.wait(0.05)
    bell.close()


def ringer_cpu_us(mode: str, rings: int) -> list[float]:
    """The ringer's CPU per ring, in microseconds, with the peer `mode` ('asleep' or 'busy')."""
    stop = mp.Event()
    peer = mp.Process(target=sleeper, args=(mode, stop), daemon=True)
    bell = Doorbell(NAMES[0])
    peer.start()
    time.sleep(0.5)  # the peer bound its doorbell
    bell.connect(NAMES)
    costs = []
    for _ in range(rings):
        time.sleep(200e-6)
        start = time.thread_time_ns()
        bell.ring(1)
        costs.append((time.thread_time_ns() - start) / 1e3)
    stop.set()
    peer.join(5)
    bell.close()
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rings", type=int, default=2000)
    args = parser.parse_args()
    for mode in ("asleep", "busy"):
        costs = sorted(ringer_cpu_us(mode, args.rings))
        p90 = costs[int(0.9 * len(costs))]
        print(f"peer {mode}: ring CPU median {statistics.median(costs):.1f} us, p90 {p90:.1f} us")


if __name__ == "__main__":
    main()

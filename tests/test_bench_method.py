"""`ubep bench`'s method without rank processes: the turn order and the timings."""

from __future__ import annotations

import threading
import time

import pytest

from ubep.bench.timing import Stats, latencies_us
from ubep.bench.turns import Calls, Conductor, Turns, round_order, take_turns

# --- turns -----------------------------------------------------------------------------------


def test_round_order_rotates_by_one_each_round():
    assert round_order(("a", "b", "c"), 4) == [
        ("a", "b", "c"),
        ("b", "c", "a"),
        ("c", "a", "b"),
        ("a", "b", "c"),
    ]
    order = round_order(("a", "b", "c", "d", "e"), 10)
    assert all(sorted(r) == ["a", "b", "c", "d", "e"] for r in order)  # each once a round
    for system in "abcde":  # and, over 5 rounds, once in each position
        assert sorted(r.index(system) for r in order[:5]) == [0, 1, 2, 3, 4]


def _thread_group(directory: str, ranks: int, systems: tuple[str, ...], log: list, lock: threading.Lock):
    """`ranks` threads taking turns as rank processes would, logging (system, rank, op) as they run."""
    results = [None] * ranks

    def rank_main(rank: int) -> None:
        def call(system: str, op: str):
            def run() -> None:
                with lock:
                    log.append((system, rank, op))

            return run

        calls = {s: Calls(call(s, "dispatch"), call(s, "combine")) for s in systems}
        turns = Turns(directory, rank, timeout_s=30)
        results[rank] = take_turns(turns, calls, time.monotonic)
        turns.close()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    return threads, results


def test_conductor_runs_one_system_at_a_time_in_round_order(tmp_path):
    """Two groups of thread 'ranks': the log, cut into runs of one system, is the round order."""
    groups = {"launch": ("ubep", "bsp-shm", "memcpy-floor"), "mpi": ("mpi",)}
    group_of = {s: g for g, systems in groups.items() for s in systems}
    systems, rounds, ranks = ("ubep", "bsp-shm", "mpi", "memcpy-floor"), 5, 3
    conductor = Conductor(str(tmp_path), dict.fromkeys(groups, ranks), timeout_s=30)
    log, lock = [], threading.Lock()
    started = {g: _thread_group(conductor.directory(g), ranks, s, log, lock) for g, s in groups.items()}
    try:
        for g in groups:
            conductor.ready(g, lambda: None)
        for order in round_order(systems, rounds):
            for system in order:
                conductor.turn(group_of[system], system, lambda: None)
    finally:
        for g in groups:
            conductor.quit(g)
        for threads, _ in started.values():
            for t in threads:
                t.join(30)
        conductor.close()
    blocks = []  # consecutive log entries of one system
    for system, rank, op in log:
        if not blocks or blocks[-1][0] != system:
            blocks.append((system, []))
        blocks[-1][1].append((rank, op))
    expected = [s for order in round_order(systems, rounds) for s in order]
    assert [b[0] for b in blocks] == expected
    for _, entries in blocks:  # every rank ran both halves in its turn, dispatch before combine
        assert sorted(entries) == sorted((r, op) for r in range(ranks) for op in ("dispatch", "combine"))
        for r in range(ranks):
            assert [op for rank, op in entries if rank == r] == ["dispatch", "combine"]
    for g, (_, results) in started.items():  # one sample per round and rank, for each system and op
        for samples in results:
            assert set(samples) == set(groups[g])
            assert all(len(samples[s][op][0]) == rounds for s in groups[g] for op in ("dispatch", "combine"))


def test_conductor_reports_a_group_that_ended_instead_of_waiting(tmp_path):
    conductor = Conductor(str(tmp_path), {"launch": 2}, timeout_s=60)

    def ended() -> None:
        raise RuntimeError("rank 1 failed: boom")

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="boom"):
        conductor.turn("launch", "ubep", ended)
    assert time.monotonic() - start < 5
    conductor.close()


def test_a_rank_without_a_turn_times_out(tmp_path):
    conductor = Conductor(str(tmp_path), {"launch": 1}, timeout_s=1)
    turns = Turns(conductor.directory("launch"), 0, timeout_s=0.2)
    with pytest.raises(TimeoutError, match="no turn"):
        turns.next()
    turns.close()
    conductor.close()


# --- timings ---------------------------------------------------------------


def test_latencies_take_the_slowest_rank_from_the_common_start():
    starts = [10.0, 20.0, 30.0]
    finishes = [[10.001, 20.004, 30.002], [10.003, 20.001, 30.002]]  # rank 0, rank 1
    assert latencies_us(starts, finishes) == pytest.approx([3000, 4000, 2000])
    stats = Stats.of(latencies_us(starts, finishes))
    assert round(stats.median_us) == 3000 and round(stats.p99_us) == 4000

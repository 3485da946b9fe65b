"""A rank killed, masked by the survivors (on_peer_failure="mask"), then restarted as a new process
with the same rank: `Buffer.rejoin` takes it back in at a dispatch every rank agrees on, with no
process group of its own and no collective of the survivors' group. Every pair of calls on every
rank, the restarted process's included, is checked bit for bit against the reference fed the
membership of that call; a handle from before the rejoin is refused on every rank alike. Each
launch and each restarted process runs under its own deadline.

Rank 0 starts the restarted process (as a launcher or torchrun's agent would), with the same
environment (RANK, MASTER_ADDR, MASTER_PORT): it finds the survivors through the launcher's
rendezvous store.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from shrinkcase import NUM_EXPERTS_PER_RANK, TOPK, inputs
from test_low_latency import CAPACITY, HIDDEN
from test_peer_failure_mask import checked_pair

import ubep
from ubep.faults import FaultPlan

WORLD, DEAD = 6, 4
PAIRS_AFTER = 25  # dispatch + combine pairs once every rank is back in: 50 calls
OPTIONS = dict(
    hidden=HIDDEN,
    num_experts=NUM_EXPERTS_PER_RANK * WORLD,
    max_tokens_per_rank=CAPACITY,
    max_topk=TOPK,
    transport="shm",
    timeout_s=5.0,
    on_peer_failure="mask",
)
SCENARIO_S = 240.0  # each restart's deadline, survivors and restarted process alike
DIE_AFTER_PAIRS = 5  # a restarted process told to die again does so after this many pairs
RESTARTED = str(Path(__file__).with_name("restarted_rank.py"))  # what a restarted process runs
STAGES = [  # of its start, in order: `restarted_rank`'s, `Rejoining.stages`, then its first call pair's
    "interpreter",
    "import torch",
    "import ubep",
    "test helpers",
    "store",
    "kernels",
    "options",
    "holdings",
    "segments",
    "exchange",
    "survivors' dispatch",
    "agreed",
    "first exact pair",
]


def pair(buf: ubep.Buffer) -> set[int]:
    """One checked dispatch + combine; its inputs derive from the dispatch's call number, which every
    rank agrees on (a restarted one included). Returns the ranks masked at its end."""
    return checked_pair(buf, buf._calls.seq + 1)


def stale_handle_refused(buf: ubep.Buffer) -> None:
    """Every rank calls combine with a handle of the last dispatch before the rejoin (its number on
    a handle of this rank's shape): refused alike, so the ranks stay in step."""
    me = buf.rank
    xs, idxs, ws = inputs(7, WORLD)
    got = buf.dispatch(xs[me], topk_idx=idxs[me], topk_weights=ws[me])
    stale = dataclasses.replace(got.handle, seq=buf._membership.stale_after)
    with pytest.raises(ValueError, match="before ranks were taken back in"):
        buf.combine(got.recv_x, stale)


def restarted(die: str, started_at: float, stages: dict[str, tuple[float, float]]) -> None:
    """The process started in rank DEAD's place (`restarted_rank`, which noted the `stages` of its
    start): rejoin, then checked pairs; prints its times (JSON: seconds since `started_at`, and each
    stage's end as [those, its CPU seconds]) after the first. `die`: "" (PAIRS_AFTER pairs, the stale
    handle, one more pair), "after" (SIGKILL itself after DIE_AFTER_PAIRS pairs) or "joining" (die
    inside the agreement, after the staying ranks began taking it in)."""
    torch.set_num_threads(1)  # as the launcher sets its ranks: one core each on a shared machine
    if die == "joining":
        from ubep.transport.heap import Heap

        Heap._agree = lambda *args, **kwargs: os._exit(9)
    with ubep.Buffer.rejoin(DEAD, WORLD, **OPTIONS) as buf:
        joined = time.time()
        assert pair(buf) == set()
        first_exact = time.time()
        stages = {**stages, **buf._info.group.stages, "first exact pair": (first_exact, time.process_time())}
        times = {
            "joined_s": joined - started_at,
            "first_exact_s": first_exact - started_at,
            "stages_s": {stage: [at - started_at, cpu] for stage, (at, cpu) in stages.items()},  # in order
            "kernels": buf.engine.kernels_origin(),
        }
        print(json.dumps(times), flush=True)
        for _ in range((DIE_AFTER_PAIRS if die else PAIRS_AFTER) - 1):
            assert pair(buf) == set()
        if die == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        stale_handle_refused(buf)
        assert pair(buf) == set()


class Restarts:
    """Rank 0's side: start each restarted process in turn (a fresh interpreter with rank DEAD's
    environment, as a launcher restarts it), once the one before has exited."""

    def __init__(self, plan: list[str]):
        self._plan, self._procs = list(plan), []
        self._deadline = time.monotonic() + SCENARIO_S
        self._env = dict(
            os.environ, RANK=str(DEAD), PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1"
        )

    def tick(self) -> None:
        assert time.monotonic() < self._deadline, "the scenario ran past its deadline"
        if (not self._procs or self._procs[-1].poll() is not None) and self._plan:
            self._deadline = time.monotonic() + SCENARIO_S  # each restarted process has its own
            command = [sys.executable, RESTARTED, self._plan.pop(0), repr(time.time())]
            self._procs.append(subprocess.Popen(command, env=self._env, stdout=subprocess.PIPE, text=True))

    def finish(self) -> list[dict]:
        """Each restarted process's times (those taken in), once the last exited with 0."""
        times = []
        for proc in self._procs:
            try:
                out, _ = proc.communicate(timeout=max(self._deadline - time.monotonic(), 1.0))
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
            times += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert self._procs[-1].returncode == 0, self._procs[-1].returncode
        return times


def survive(plan: list[str]) -> dict:
    """Every rank: checked pairs until rank DEAD dies (it never returns), then through `plan`'s
    restarts: masked until a restarted process is taken in, on with it, masked again where it dies."""
    me = dist.get_rank()
    restarts = Restarts(plan) if me == 0 else None
    kill = FaultPlan(rank=DEAD, point="dispatch.start", action="kill", call=7)
    pauses, clean, deadline = [], [], time.monotonic() + SCENARIO_S  # clean: pairs with every rank in
    with ubep.Buffer(None, faults=kill, **OPTIONS) as buf:
        while not buf.masked_ranks:
            assert time.monotonic() < deadline
            pair(buf)
        dies_after = plan.count("after")
        for episode in range(dies_after + 1):
            deadline = time.monotonic() + SCENARIO_S  # each restart has its own
            while buf.masked_ranks:  # admitted at a dispatch: the pair that ends unmasked
                assert time.monotonic() < deadline, "never taken back in"
                if restarts is not None:
                    restarts.tick()
                started = time.monotonic()
                pair(buf)
                if not buf.masked_ranks:  # the pair whose dispatch took it in
                    pauses.append(time.monotonic() - started)
            if episode < dies_after:
                while not buf.masked_ranks:
                    assert time.monotonic() < deadline, "the restarted process never died"
                    pair(buf)
        for _ in range(PAIRS_AFTER - 1):
            started = time.monotonic()
            assert pair(buf) == set()
            clean.append(time.monotonic() - started)
        stale_handle_refused(buf)
        assert pair(buf) == set()
    joiners = restarts.finish() if restarts is not None else None
    return {"pauses": pauses, "clean": statistics.median(clean), "joiners": joiners}


def run(plan: list[str]) -> list[dict]:
    launch = ubep.LocalLaunch(world_size=WORLD, timeout_s=SCENARIO_S * len(plan) + 60)
    outcomes = launch.outcomes(survive, plan)
    assert outcomes[DEAD].cause == "died", outcomes[DEAD]
    failed = [f"rank {o.rank} ({o.cause}):\n{o.error}" for o in outcomes if o.rank != DEAD and not o.ok]
    if failed:
        pytest.fail("\n".join(failed))
    return [o.result for o in outcomes if o.rank != DEAD]


@pytest.mark.timeout(330)
def test_a_killed_rank_restarted_rejoins_and_every_rank_runs_50_exact_calls():
    results = run([""])
    assert all(len(r["pauses"]) == 1 for r in results), results  # taken in at one dispatch, by all
    assert len(results[0]["joiners"]) == 1, results[0]
    stages = results[0]["joiners"][0]["stages_s"]  # where its start went (scripts/rejoin_times.py)
    assert list(stages) == STAGES, stages
    walls, cpus = zip(*stages.values(), strict=True)
    assert 0 <= walls[0] and list(walls) == sorted(walls) and list(cpus) == sorted(cpus), stages


@pytest.mark.timeout(600)
def test_a_rank_rejoins_twice():
    results = run(["after", ""])
    assert all(len(r["pauses"]) == 2 for r in results), results


@pytest.mark.timeout(600)
def test_a_restarted_rank_that_dies_while_joining_does_not_hang_the_survivors():
    results = run(["joining", ""])
    assert all(len(r["pauses"]) == 1 for r in results), results  # only the second one taken in

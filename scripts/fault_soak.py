"""Soak with faults: checked dispatch/combine iterations while ranks are killed, stalled and made to
publish corrupt counts, the survivors masking the dead and going on.

    python scripts/fault_soak.py --iterations 10000 --world-size 4 --protocol ubep

The run is a series of segments, each a fresh group of `--world-size` ranks (a job restart) running
`--segment` iterations (one iteration: a dispatch, its combine, and every fourth a cached dispatch,
as in `soak.py`). In each segment, at iterations drawn from the seed:
  corrupt  one rank publishes an impossible token count: every rank's call fails (PeerDataError or
           PeerAbortedError), nobody is masked, the next iteration runs on everyone;
  kill     one rank SIGKILLs itself at a random moment of an iteration: the survivors' call fails
           naming it, they mask it (`Buffer.mask_ranks`) and go on without it;
  stall    one rank sleeps past the deadline: the others' call fails naming it, they mask it; when
           it wakes, its next call fails (it was masked) and it leaves.
Every call that returns is checked bit for bit against `ubep.reference`, restricted to the ranks
still taking part (a masked rank sends nothing; entries selecting its experts are dropped). The
report gives calls checked, wrong results (must be 0), each fault's detection time, whether the
survivors blamed the right rank, and shared-memory names left behind (must be 0).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import threading
import time
from dataclasses import asdict, dataclass, field

import torch.distributed as dist
from rich.console import Console
from soak import Checked, SoakConfig, check_call, shm_state

import ubep
from ubep.errors import CommTimeoutError, UbepError
from ubep.faults import FaultPlan
from ubep.shm import SHM_DIR, segment_pid
from ubep.waiting import PeerAbortedError

ITERATION_COST = (2, 2, 2, 3)  # calls per iteration, by iteration % 4 (every fourth repeats the dispatch)


@dataclass(frozen=True, kw_only=True)
class FaultSoakConfig:
    iterations: int = 10_000
    segment: int = 400  # iterations per group of ranks
    world_size: int = 4
    protocol: str = "ubep"
    timeout_s: float = 2.0  # the Buffer's deadline: a stall lasts 1.5x this
    seed: int = 0

    def soak(self, segment: int) -> SoakConfig:
        """The inputs' configuration for one segment (its own seed, so segments differ)."""
        return SoakConfig(
            world_size=self.world_size,
            protocol=self.protocol,
            timeout_s=self.timeout_s,
            seed=self.seed * 7919 + segment,
        )


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """Which rank does what at which iteration of one segment (rank 0 is never a victim: it reports)."""

    corrupt_rank: int
    corrupt_at: int
    kill_rank: int
    kill_at: int
    kill_delay_s: float  # into the kill iteration
    stall_rank: int
    stall_at: int

    @classmethod
    def draw(cls, cfg: FaultSoakConfig, segment: int) -> Schedule:
        rng = random.Random(cfg.seed * 104_729 + segment)
        n, victims = cfg.segment, rng.sample(range(1, cfg.world_size), 2)
        return cls(
            corrupt_rank=rng.randrange(cfg.world_size),
            corrupt_at=rng.randrange(n // 10, n // 4),
            kill_rank=victims[0],
            kill_at=rng.randrange(n // 3, n // 2),
            kill_delay_s=rng.uniform(0, 0.01),
            stall_rank=victims[1],
            stall_at=rng.randrange(2 * n // 3, 5 * n // 6),
        )

    def corrupt_call(self) -> int:
        """The seq of the corrupt iteration's dispatch (no mask before it, so every call counts)."""
        return sum(ITERATION_COST[i % 4] for i in range(self.corrupt_at)) + 1


@dataclass(kw_only=True)
class RankLog:
    rank: int
    checked: Checked = field(default_factory=Checked)  # calls compared with the reference, failures
    faults: list[dict] = field(default_factory=list)  # each fault this rank saw: kind, blame, seconds


def blamed(error: UbepError) -> set[int]:
    """The ranks an error names as the cause."""
    if isinstance(error, CommTimeoutError):
        return set(error.dead_peers or error.peers)
    if isinstance(error, PeerAbortedError):
        return {error.culprit if error.culprit is not None else error.peer}
    return set()


def segment_rank(cfg: FaultSoakConfig, segment: int, plan: Schedule) -> tuple[RankLog, list[str]]:
    """One rank's segment; returns its log and (rank 0) the group's names left in /dev/shm."""
    me, R = dist.get_rank(), dist.get_world_size()
    pids: list[int] = [0] * R
    dist.all_gather_object(pids, os.getpid())
    soak_cfg, log, masked = cfg.soak(segment), RankLog(rank=me), set()
    corrupt = FaultPlan(
        rank=plan.corrupt_rank, point="dispatch.count", action="corrupt", call=plan.corrupt_call(), value=-1
    )
    with soak_cfg.buffer(R, faults=corrupt) as buf:
        i = 0
        while i < cfg.segment:
            if me == plan.kill_rank and i == plan.kill_at:
                threading.Timer(plan.kill_delay_s, os.kill, (os.getpid(), signal.SIGKILL)).start()
            if me == plan.stall_rank and i == plan.stall_at:
                time.sleep(1.5 * cfg.timeout_s)
            start = time.monotonic()
            try:
                check_call(buf, soak_cfg, i, log.checked, frozenset(masked))
                if me == plan.kill_rank and i == plan.kill_at:
                    time.sleep(3600)  # the timer kills this rank during or right after its iteration
                i += 1
            except UbepError as error:
                seen = {
                    "iteration": i,
                    "error": type(error).__name__,
                    "s": round(time.monotonic() - start, 3),
                }
                if me == plan.stall_rank and i >= plan.stall_at:  # woke up masked: leave
                    log.faults.append({"kind": "stalled (this rank)", **seen})
                    buf.mask_ranks([me])
                    break
                if i == plan.corrupt_at:
                    log.faults.append({"kind": "corrupt", "blame": sorted(blamed(error)), **seen})
                    i += 1
                    continue
                kind, victim, at = (
                    ("kill", plan.kill_rank, plan.kill_at)
                    if plan.kill_at <= i <= plan.kill_at + 1
                    else ("stall", plan.stall_rank, plan.stall_at)
                )
                if kind == "stall" and i != plan.stall_at:
                    raise  # no fault was injected here: a real failure
                log.faults.append({"kind": kind, "victim": victim, "blame": sorted(blamed(error)), **seen})
                buf.mask_ranks([victim])
                masked.add(victim)
                i = at + 2  # every survivor failed in iteration `at` or the next: all resume here
        names = [n for n in os.listdir(SHM_DIR) if segment_pid(n) in set(pids) - {os.getpid()}]
    return log, names if me == 0 else []


@dataclass(frozen=True, kw_only=True)
class FaultSoakReport:
    config: FaultSoakConfig
    segments: int
    checked_calls: int
    wrong: list[str]
    faults: list[dict]
    misblamed: list[dict]
    left_names: list[str]
    ubep_names_before: int
    ubep_names_after: int
    wall_s: float


def run(cfg: FaultSoakConfig, console: Console | None = None) -> FaultSoakReport:
    """Every segment in turn, each a fresh group; progress on `console` after each segment."""
    _, names_before = shm_state()
    start = time.monotonic()
    checked, wrong, faults, misblamed, left = 0, [], [], [], []
    segments = -(-cfg.iterations // cfg.segment)
    for segment in range(segments):
        plan = Schedule.draw(cfg, segment)
        outcomes = ubep.LocalLaunch(world_size=cfg.world_size, timeout_s=600).outcomes(
            segment_rank, cfg, segment, plan
        )
        for rank, outcome in enumerate(outcomes):
            if rank == plan.kill_rank:
                if outcome.cause != "died":
                    wrong.append(
                        f"segment {segment}: rank {rank} should have been killed, ended {outcome.cause}"
                    )
                continue
            if not outcome.ok:
                wrong.append(
                    f"segment {segment}: rank {rank} {outcome.cause}: {(outcome.error or '')[-400:]}"
                )
                continue
            log, names = outcome.result
            checked += log.checked.calls
            wrong += [f"segment {segment} rank {rank} {w}" for w in log.checked.wrong]
            left += names
            for fault in log.faults:
                faults.append({"segment": segment, "rank": rank, **fault})
                if "victim" in fault and fault["blame"] != [fault["victim"]]:
                    misblamed.append(faults[-1])
        if console is not None:
            console.print(
                f"fault soak: segment {segment + 1}/{segments}, {checked} calls checked, {len(wrong)} wrong, "
                f"{len(faults)} faults seen, {time.monotonic() - start:.0f} s",
                highlight=False,
            )
    _, names_after = shm_state()
    return FaultSoakReport(
        config=cfg,
        segments=segments,
        checked_calls=checked,
        wrong=wrong,
        faults=faults,
        misblamed=misblamed,
        left_names=left,
        ubep_names_before=names_before,
        ubep_names_after=names_after,
        wall_s=time.monotonic() - start,
    )


def summary(report: FaultSoakReport) -> dict:
    """Per fault kind: how many survivors saw it, and their detection times (s): median and max."""
    kinds: dict[str, list[float]] = {}
    for fault in report.faults:
        kinds.setdefault(fault["kind"], []).append(fault["s"])
    return {
        kind: {"seen": len(t), "median_s": sorted(t)[len(t) // 2], "max_s": max(t)}
        for kind, t in kinds.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=FaultSoakConfig.iterations)
    parser.add_argument("--segment", type=int, default=FaultSoakConfig.segment)
    parser.add_argument("--world-size", type=int, default=FaultSoakConfig.world_size)
    parser.add_argument("--protocol", default=FaultSoakConfig.protocol, choices=("ubep", "bsp"))
    parser.add_argument("--seed", type=int, default=FaultSoakConfig.seed)
    parser.add_argument("--json", help="also write the report as JSON to this file")
    args = parser.parse_args()
    if args.world_size < 3:
        parser.error("--world-size must be at least 3 (two victims per segment, and rank 0)")
    cfg = FaultSoakConfig(
        iterations=args.iterations,
        segment=args.segment,
        world_size=args.world_size,
        protocol=args.protocol,
        seed=args.seed,
    )
    console = Console()
    report = run(cfg, console)
    console.print(
        f"fault soak: {report.segments} segments, {report.checked_calls} calls checked, "
        f"{len(report.wrong)} wrong, {len(report.misblamed)} misblamed, faults {summary(report)}, "
        f"names left {len(report.left_names)} (ubep-* names {report.ubep_names_before} -> "
        f"{report.ubep_names_after}), wall {report.wall_s:.0f} s",
        highlight=False,
    )
    for line in report.wrong[:10]:
        console.print(line, highlight=False)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(report) | {"summary": summary(report)}, f, indent=2)
    raise SystemExit(1 if report.wrong or report.misblamed or report.left_names else 0)


if __name__ == "__main__":
    main()

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
After each segment, a second fresh group runs `--stops` stop-inside-put episodes, each on a fresh
Buffer (`stop_rank`):
  stop     one rank freezes (SIGSTOP) inside a low-latency combine's put, after its rows went to
           one home and its membership check passed; the others' call fails naming it, they mask
           it, send two low-latency dispatches and combines (both halves of the slots, receive
           halves deferred), then wake it (SIGCONT): it puts its next home's rows into a
           survivor (the late write) and must stop with MaskedOutError; only then do the
           survivors run their receive halves, and more calls, all checked.
Every call that returns is checked bit for bit against `ubep.reference`, restricted to the ranks
still taking part (a masked rank sends nothing; entries selecting its experts are dropped). The
report gives calls checked, wrong results (must be 0), each fault's detection time, whether the
survivors blamed the right rank, and shared-memory names left behind (must be 0).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.distributed as dist
from rich.console import Console
from soak import Checked, SoakConfig, call_inputs, check_call, shm_state

import ubep
from ubep import reference
from ubep.errors import CommTimeoutError, MaskedOutError, UbepError
from ubep.faults import FaultPlan
from ubep.transport.segments import SHM_DIR, segment_pid
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
    stops: int = 8  # stop-inside-put episodes after each segment (25 segments: 200)
    stop_timeout_s: float = 2.0  # the deadline in those episodes (a frozen rank is seen at it)
    engine: str = "auto"

    def soak(self, segment: int, timeout_s: float | None = None) -> SoakConfig:
        """The inputs' configuration for one segment (its own seed, so segments differ)."""
        return SoakConfig(
            world_size=self.world_size,
            protocol=self.protocol,
            timeout_s=self.timeout_s if timeout_s is None else timeout_s,
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


# -- stop inside a put -------------------------------------------------------------------------------

STOP_CALL = 2  # the low-latency combine of each episode (call 1: its dispatch)


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (state T in /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def _mark(path: str, text: str = "") -> None:
    """Create `path` holding `text`, whole at once (another rank waits for it: `_await_file`)."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.rename(path + ".tmp", path)


def _await_file(path: str, timeout_s: float) -> str:
    """The contents of `path` once it exists (another rank writes it), or TimeoutError."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.005)
    with open(path) as f:
        return f.read()


def check_low_latency(
    buf: ubep.Buffer, cfg: SoakConfig, call: int, checked: Checked, masked: frozenset[int], deferred: bool
):
    """A low-latency dispatch (checked now) and its combine; with `deferred`, the combine's receive
    half waits: returns (its hook, a check to run after it). Without, both are checked now."""
    me, R = buf.rank, buf.num_ranks
    E, T = cfg.experts_per_rank * R, cfg.capacity
    xs, idxs, ws = call_inputs(cfg, call, R)
    rx, ri, rw = reference.without_ranks(xs, idxs, ws, masked, E)
    ref = reference.low_latency_dispatch(rx, ri, E, T)
    got = buf.low_latency_dispatch(xs[me], idxs[me], T, E)
    count = ref[me].recv_count_L
    rows = all(
        torch.equal(got.recv_x[j, :c], ref[me].recv_x_LMX[j, :c]) for j, c in enumerate(count.tolist())
    )
    checked.calls += 1
    checked.wrong += [f"low-latency call {call}: dispatch"] * (
        not (rows and torch.equal(got.recv_count, count))
    )
    ys = [(r.recv_x_LMX.float() * (1 + q)).to(r.recv_x_LMX.dtype) for q, r in enumerate(ref)]
    want = reference.low_latency_combine(ys, ref, ri, rw)[me]
    out = buf.low_latency_combine(ys[me], idxs[me], ws[me], got.handle, return_recv_hook=deferred)

    def check() -> None:
        checked.calls += 1
        if not torch.equal(out.combined_x, want):
            checked.wrong.append(f"low-latency call {call}: combine")

    if not deferred:
        check()
    return out.hook, check


def stop_rank(cfg: FaultSoakConfig, segment: int, episodes: int, files: str) -> tuple[RankLog, list[str]]:
    """One rank's stop-inside-put episodes (see the module docstring), each on a fresh Buffer;
    `files` is a directory the ranks share for the wake-up handshake."""
    me, R = dist.get_rank(), dist.get_world_size()
    pids: list[int] = [0] * R
    dist.all_gather_object(pids, os.getpid())
    soak_cfg, log = cfg.soak(segment, cfg.stop_timeout_s), RankLog(rank=me)
    first = replace(soak_cfg, timeout_s=120)  # compile and load first
    with first.buffer(R, engine=cfg.engine, low_latency=True) as buf:
        check_low_latency(buf, soak_cfg, 0, log.checked, frozenset(), deferred=False)
        check_call(buf, soak_cfg, 1, log.checked)
    rng = random.Random(cfg.seed * 15_485_863 + segment)
    for episode in range(episodes):
        victim, base = rng.randrange(1, R), 1_000_000 * (segment + 1) + 100 * episode
        files_at = (f"{files}/woke-{segment}-{episode}", f"{files}/cont-{segment}-{episode}")
        plan = FaultPlan(rank=victim, point="ll_combine.put", action="stop", call=STOP_CALL)
        with soak_cfg.buffer(R, faults=plan, engine=cfg.engine, low_latency=True) as buf:
            if me == victim:
                _stopped_rank(buf, soak_cfg, base, files_at, log)
                continue
            try:
                _staying_rank(buf, soak_cfg, base, victim, pids, files_at, log)
            except BaseException:
                with contextlib.suppress(ProcessLookupError):  # a failing test must not leave it frozen
                    os.kill(pids[victim], signal.SIGCONT)
                raise
    names = [n for n in os.listdir(SHM_DIR) if segment_pid(n) in set(pids) - {os.getpid()}]
    return log, names if me == 0 else []


def _stopped_rank(buf: ubep.Buffer, cfg: SoakConfig, base: int, files_at: tuple[str, str], log: RankLog):
    """The victim's episode: freeze inside the combine's put; woken, it must raise MaskedOutError."""
    woke, cont = files_at
    try:
        check_low_latency(buf, cfg, base, Checked(), frozenset(), deferred=False)
        error: Exception | None = None
    except UbepError as e:
        error = e
    now = time.monotonic()
    _mark(woke, type(error).__name__)
    woken_s = now - float(_await_file(cont, 30))
    kind = "stopped inside put (this rank)"
    log.faults.append({"kind": kind, "error": type(error).__name__, "s": round(woken_s, 3)})
    if not isinstance(error, MaskedOutError):
        log.checked.wrong.append(f"call {base}: the woken rank got {error!r}")


def _staying_rank(
    buf: ubep.Buffer,
    cfg: SoakConfig,
    base: int,
    victim: int,
    pids: list[int],
    files_at: tuple[str, str],
    log: RankLog,
) -> None:
    """A survivor's episode: its call fails naming the victim (or finishes, where the victim put
    its rows here before freezing); mask it; two calls sent, their receive halves held; wake it;
    once its late put landed, run the receive halves and more calls, all checked."""
    woke, cont = files_at
    start = time.monotonic()
    try:
        check_low_latency(buf, cfg, base, log.checked, frozenset(), deferred=False)
    except UbepError as error:
        seen = {"kind": "stop", "victim": victim, "blame": sorted(blamed(error))}
        log.faults.append({**seen, "error": type(error).__name__, "s": round(time.monotonic() - start, 3)})
    # A survivor the victim served before freezing finishes at once; the others wait out the
    # deadline, as long as the mask's own: every survivor enters the mask once all are through.
    _mark(f"{woke}-through-{buf.rank}")
    for r in range(buf.num_ranks):
        if r != victim:
            _await_file(f"{woke}-through-{r}", 30)
    buf.mask_ranks([victim])
    without = frozenset({victim})
    pending = [
        check_low_latency(buf, cfg, base + i, log.checked, without, deferred=True) for i in (1, 2)
    ]  # both halves of the slots hold rows of live peers, not yet read
    if buf.rank == 0:
        deadline = time.monotonic() + 30
        while not _stopped(pids[victim]) and time.monotonic() < deadline:
            time.sleep(0.005)
        _mark(cont, repr(time.monotonic()))
        os.kill(pids[victim], signal.SIGCONT)
    _await_file(woke, 30)  # its late put has landed
    for hook, check in pending:
        hook()
        check()
    for i in (3, 4):
        check_low_latency(buf, cfg, base + i, log.checked, without, deferred=False)
    check_call(buf, cfg, base + 5, log.checked, without)


def run_stops(
    cfg: FaultSoakConfig, segment: int, episodes: int
) -> tuple[int, list[str], list[dict], list[dict]]:
    """One group's stop-inside-put episodes: (calls checked, wrong, faults seen, misblamed)."""
    checked, wrong, faults, misblamed = 0, [], [], []
    with tempfile.TemporaryDirectory(prefix="ubep-stops-") as files:
        launch = ubep.LocalLaunch(world_size=cfg.world_size, timeout_s=180 + 20 * episodes)
        outcomes = launch.outcomes(stop_rank, cfg, segment, episodes, files)
    for rank, outcome in enumerate(outcomes):
        if not outcome.ok:
            wrong.append(f"stops {segment}: rank {rank} {outcome.cause}: {(outcome.error or '')[-400:]}")
            continue
        log, names = outcome.result
        checked += log.checked.calls
        wrong += [f"stops {segment} rank {rank} {w}" for w in log.checked.wrong]
        wrong += [f"stops {segment}: name left {n}" for n in names]
        for fault in log.faults:
            faults.append({"segment": segment, "rank": rank, **fault})
            if "victim" in fault and fault["blame"] != [fault["victim"]]:
                misblamed.append(faults[-1])
    return checked, wrong, faults, misblamed


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
        if cfg.stops:
            more, *lists = run_stops(cfg, segment, cfg.stops)
            checked += more
            for mine, theirs in zip((wrong, faults, misblamed), lists, strict=True):
                mine += theirs
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
    parser.add_argument(
        "--stops", type=int, default=FaultSoakConfig.stops, help="stop-inside-put episodes per segment"
    )
    parser.add_argument("--engine", default=FaultSoakConfig.engine, choices=("auto", "torch", "numba"))
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
        stops=args.stops,
        engine=args.engine,
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

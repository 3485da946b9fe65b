"""Running the benchmark: per batch size, every system taking turns round by round, then the rows.

plan(cfg)          which systems can run here, and a note for each one left out
run(cfg, ...)      per batch size: start the groups, `warmup + iters` rounds of turns, rows out
  launch group     ubep, bsp-shm, bsp-gloo, memcpy-floor: ubep's launcher, waited on in a thread
                   (with --hosts: torchrun on namespace hosts, see hosts)
  mpi group        mpirun's job (see mpi_system)
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace
from typing import Protocol

import numpy as np
from rich.console import Console
from rich.progress import Progress as RichProgress

from ubep.across.collectives.bsp_hier import boundary_bytes
from ubep.bench import mpi_system, placed, report
from ubep.bench.hosts import HostsGroup
from ubep.bench.timing import latencies_us
from ubep.bench.torch_systems import BUFFER_SYSTEMS, measure_rank
from ubep.bench.turns import Conductor, Samples, round_order
from ubep.bench.workload import LL_ROW, UBEP_ROW, BenchConfig, build
from ubep.errors import SharedMemorySizeError
from ubep.extras import install_hint
from ubep.factory import ready_engine
from ubep.launcher import LocalLaunch
from ubep.layout import ExpertPlacement, token_in_rank
from ubep.registry import DIST, HIER, TIERS
from ubep.sim.tiers import Stack, tier_bytes
from ubep.transport.segments import KNOBS

SINGLE_HOST = ("bsp-shm", "mpi", LL_ROW)  # no row across emulated nodes
ACROSS_ONLY = ("hier-bsp", "ubep-gloo", "ubep-nixl", "ubep-tiers", "ubep-dist")  # rows between nodes
NORMAL_ONLY = ("bsp-shm", "mpi")  # no low-latency mode
STOP_S = 30.0  # how long a stopped group gets to wind down


def boundary_per_rank(cfg: BenchConfig, tokens: int) -> dict[str, float]:
    """Mean bytes per rank and call (dispatch + combine) that cross emulated node boundaries."""
    if cfg.nodes == 1:
        return {}
    work = build(cfg, tokens)
    node_of_rank = [r // (cfg.ranks // cfg.nodes) for r in range(cfg.ranks)]
    placement = ExpertPlacement.contiguous(cfg.experts, cfg.ranks)
    got = boundary_bytes(work.topk_idx, placement, node_of_rank, cfg.hidden, work.xs[0].dtype)

    def mean(kind: str) -> float:
        return (sum(got[f"dispatch_bytes_{kind}"]) + sum(got[f"combine_bytes_{kind}"])) / cfg.ranks

    # hier: a token crosses once per remote node (float32 partials back); dist: once per remote rank
    per_transport = {HIER.name: mean("dedup"), DIST.name: mean("flat")}
    crossing = {"hier-bsp": per_transport[HIER.name]}
    crossing |= {row: mean("flat") for row in ("bsp-gloo", "ubep-dist")}  # the same rows on the wire
    crossing |= {
        row: per_transport[BUFFER_SYSTEMS[row].transport_for(cfg)]
        for row in (UBEP_ROW, "ubep-gloo", "ubep-nixl")
    }
    if cfg.racks > 1:  # once per rack, then per host: what crosses hosts on either tier
        stack = Stack(racks=cfg.racks, hosts_per_rack=cfg.nodes // cfg.racks,
                      ranks_per_host=cfg.ranks // cfg.nodes, link_gbps=1.0, rack_gbps=1.0)  # fmt: skip
        hit_RNR = np.stack([token_in_rank(i, placement).numpy() for i in work.topk_idx])
        tiers = tier_bytes(TIERS.name, stack, hit_RNR, cfg.hidden, work.xs[0].element_size(), cfg.topk)
        crossing["ubep-tiers"] = (tiers["slow"] + tiers["fast"]) / cfg.ranks
    return crossing


def select_systems(cfg: BenchConfig, mpi: tuple[bool, str]) -> tuple[tuple[str, ...], list[str]]:
    """The requested systems that can run under `cfg`, and a note for each left out.

    `mpi` is (whether the mpi row can run here, why not). Raises ValueError,
    naming every reason, when no system is left.
    """
    systems, notes = list(cfg.systems), []
    if cfg.nodes == 1 and (across := [s for s in systems if s in ACROSS_ONLY]):
        systems = [s for s in systems if s not in across]
        notes.append(f"one node: no {', '.join(across)} row (they cross nodes; try --nodes or --hosts)")
    if "ubep-nixl" in systems and not (nixl := nixl_available())[0]:
        systems.remove("ubep-nixl")
        notes.append(f"ubep-nixl row skipped: {nixl[1]}")
    if cfg.nodes > 1:
        single_host = [s for s in systems if s in SINGLE_HOST]
        systems = [s for s in systems if s not in single_host]
        notes.append(
            f"{cfg.nodes} {'namespace hosts' if cfg.namespaces else 'emulated nodes'} of "
            f"{cfg.ranks // cfg.nodes} ranks: ubep runs the transport auto picks, "
            + (
                "the hierarchical one (one crossing per token and node) with rails"
                if BUFFER_SYSTEMS[UBEP_ROW].transport_for(cfg) == HIER.name
                else "dist (one rank per host: every peer directly, bf16 rows back where hier sends "
                "float32 partials)"
            )
            + " over the default fabric (zmq where pyzmq is installed), "
            "ubep-gloo and ubep-nixl the same over gloo and nixl, hier-bsp "
            "the hierarchical transport's rail all-to-alls, bsp-gloo the flat all-to-all"
            + (f"; no {', '.join(single_host)} row (one host only)" if single_host else "")
        )
    if cfg.racks > 1:
        notes.append(
            f"{cfg.racks} racks of {cfg.nodes // cfg.racks} hosts: ubep-tiers runs transport tiers (a token "
            "crosses between racks once per rack, then between hosts once per host), ubep-dist every peer "
            "directly over the default fabric"
        )
    if cfg.mode == "ll":
        unsupported = [s for s in systems if s in NORMAL_ONLY]
        systems = [s for s in systems if s not in unsupported]
        if unsupported:
            notes.append(
                f"ll mode: no {', '.join(unsupported)} row (low-latency mode is ubep's protocol on "
                "shared memory, or the collective path, shown as bsp-gloo)"
            )
        if LL_ROW in systems:
            systems.remove(LL_ROW)
            notes.append(f"ll mode: no {LL_ROW} row (the ubep row is low-latency mode here)")
    elif LL_ROW in systems:
        notes.append(f"{LL_ROW}: ubep's low-latency mode in the same rounds (its x ubep: over normal mode)")
    if cfg.stats_path and UBEP_ROW in systems:  # beside ubep, in the same rounds: the overhead A/B
        systems.insert(systems.index(UBEP_ROW) + 1, "ubep-stats")
    if "mpi" in systems and not mpi[0]:
        systems.remove("mpi")
        notes.append(f"mpi row skipped: {mpi[1]}")
    if not systems:
        raise ValueError(f"no system left to run from --systems {','.join(cfg.systems)}: {'; '.join(notes)}")
    return tuple(systems), notes


def nixl_available() -> tuple[bool, str]:
    """Whether the nixl fabric can be imported here, and if not, why."""
    if any(importlib.util.find_spec(name) for name in ("nixl", "nixl_cu12", "nixl_cu13")):
        return True, "NIXL is installed"
    return False, f"NIXL is not installed ({install_hint('nixl')})"


def plan(cfg: BenchConfig) -> tuple[tuple[str, ...], list[str]]:
    """The systems to run and the notes for the report; compiles (or loads) the kernels once,
    here, before any rank starts."""
    systems, notes = select_systems(cfg, mpi_system.available() if "mpi" in cfg.systems else (True, ""))
    if placed.systems(cfg) and cfg.mode == "normal" and UBEP_ROW in systems:
        systems += placed.systems(cfg)
    elif placed.systems(cfg):
        notes.append("--placement rows need normal mode and the ubep row: none run")
    engine, why = ready_engine("auto")  # compiles (or loads) every kernel once, before any rank starts
    return systems, [f"engine: {engine.name} ({why})", *notes]


class LaunchGroup:
    """The systems measured inside ubep's launcher; the launch is waited on in a thread here."""

    def __init__(self, cfg: BenchConfig, tokens: int, systems: tuple[str, ...], turns_dir: str):
        launch = LocalLaunch(
            world_size=cfg.ranks, timeout_s=cfg.timeout_s * 4, ranks_per_node=cfg.ranks // cfg.nodes
        )
        self._result: list[Samples] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(launch, cfg, tokens, systems, turns_dir), name="ubep-bench-launch"
        )
        self._thread.daemon = True
        self._thread.start()

    def _run(self, launch: LocalLaunch, *args) -> None:
        try:
            self._result = launch.run(measure_rank, *args)
        except BaseException as error:
            self._error = error

    def check(self) -> None:
        """Raise the launch's error if it has ended (called while it should still be taking turns)."""
        if not self._thread.is_alive():
            raise self._error or RuntimeError("the launched ranks ended before their last turn")

    def finish(self) -> list[Samples]:
        """After QUIT: every rank's samples, in rank order."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result

    def stop(self) -> None:
        self._thread.join(STOP_S)


Timings = dict[str, tuple[list[float], list[list[float]]]]  # op -> (starts, finishes per rank)


def gathered(per_rank: list[Samples], system: str) -> Timings:
    """One system's samples from every rank of the launch, as the mpi job reports its own."""
    return {
        op: (starts, [rank[system][op][1] for rank in per_rank])
        for op, (starts, _) in per_rank[0][system].items()
    }


def start_group(
    name: str, cfg: BenchConfig, tokens: int, systems: tuple[str, ...], turns_dir: str
) -> LaunchGroup | HostsGroup | mpi_system.MpiJob:
    if name == "mpi":
        return mpi_system.MpiJob(cfg, tokens, turns_dir)
    group = HostsGroup if cfg.namespaces else LaunchGroup
    return group(cfg, tokens, tuple(s for s in systems if s != "mpi"), turns_dir)


class Progress(Protocol):
    """What the bench says while it runs (`Lines` in a log, `Bar` on a terminal)."""

    def starting(self, tokens: int) -> None: ...  # a batch size's ranks are being started
    def opened(self, system: str) -> None: ...  # a row is open and checked, its turns can start
    def advance(self) -> None: ...  # a round of turns is done
    def measured(self, rows: list[report.Row]) -> None: ...  # a batch size's rows are in


def take_rounds(
    cfg: BenchConfig, tokens: int, systems: tuple[str, ...], progress: Progress
) -> dict[str, Timings]:
    """`warmup + iters` rounds of every system at one batch size, one entry per round."""
    group_of = {s: "mpi" if s == "mpi" else "launch" for s in systems}
    names = tuple(dict.fromkeys(group_of.values()))
    with tempfile.TemporaryDirectory(prefix="ubep-bench-") as root:
        conductor = Conductor(root, dict.fromkeys(names, cfg.ranks), cfg.timeout_s * 4)
        groups: dict[str, LaunchGroup | HostsGroup | mpi_system.MpiJob] = {}
        try:
            for name in names:
                groups[name] = start_group(name, cfg, tokens, systems, conductor.directory(name))
            conductor.ready({name: group.check for name, group in groups.items()}, progress.opened)
            for order in round_order(systems, cfg.warmup + cfg.iters):
                for system in order:
                    conductor.turn(group_of[system], system, groups[group_of[system]].check)
                progress.advance()
            for name in groups:
                conductor.quit(name)
            results = {name: group.finish() for name, group in groups.items()}
        except BaseException:
            for name in groups:
                conductor.quit(name)  # ranks waiting for a turn return; a rank mid-turn finishes it first
            raise
        finally:
            for group in groups.values():
                group.stop()
            conductor.close()
    return {s: results["mpi"] if s == "mpi" else gathered(results["launch"], s) for s in systems}


def measure(cfg: BenchConfig, tokens: int, systems: tuple[str, ...], progress: Progress) -> list[report.Row]:
    """One batch size: every system's row, ratios filled in; the warm-up rounds are dropped."""
    timings = take_rounds(cfg, tokens, systems, progress)
    work = build(cfg, tokens)
    nbytes = {mode: work.bytes_per_rank(mode) for mode in {cfg.mode, "ll"}}
    crossing = boundary_per_rank(cfg, tokens)
    if cfg.nodes > 1 and placed.systems(cfg):
        per_rank = {
            s: x.cross_node_bytes / cfg.ranks for s, x in placed.stats(cfg, build(cfg, tokens)).items()
        }
        crossing |= {s: b for s, b in per_rank.items() if s != UBEP_ROW}
    rows = []
    for system in systems:
        d, c = (latencies_us(*timings[system][op])[cfg.warmup :] for op in ("dispatch", "combine"))
        row = report.Row.build(system, cfg.mode, tokens, nbytes["ll" if system == LL_ROW else cfg.mode], d, c)
        rows.append(replace(row, boundary_bytes=crossing.get(system)))
    return report.with_ratios(rows)


def room_refused(error: BaseException) -> str | None:
    """A rank's SharedMemorySizeError, from the traceback a launch's error carries, in the command
    line's terms (its advice names the Python arguments); None where the ranks failed otherwise."""
    for line in reversed(str(error).splitlines()):
        _, found, said = line.partition(f"{SharedMemorySizeError.__name__}: ")
        if found:
            return (
                f"{said.replace(f'; {KNOBS}', '')}. Lower --tokens (the largest sizes every row's Buffer), "
                "or measure fewer --systems at once (each row keeps its Buffer open)"
            )
    return None


def run(cfg: BenchConfig, systems: tuple[str, ...], measured: Callable[[list[report.Row]], None]) -> None:
    """Every batch size in turn; `measured` gets each one's rows as soon as they are in. Progress goes
    to stderr: a bar on a terminal, else lines (`Lines`), so a log is never silent for long."""
    with ExitStack() as stack:
        if sys.stderr.isatty():
            progress: Progress = stack.enter_context(Bar(cfg, systems))
        else:
            progress = Lines(cfg, systems)
        for tokens in cfg.tokens:
            progress.starting(tokens)
            rows = measure(cfg, tokens, systems, progress)
            progress.measured(rows)
            measured(rows)


def starting_what(cfg: BenchConfig, systems: tuple[str, ...]) -> str:
    """What a batch size starts: the launch group's ranks and the MPI job, each with its rows."""
    launched = [s for s in systems if s != "mpi"]
    where = f" on {cfg.nodes} namespace hosts (torchrun)" if cfg.namespaces else ""
    said = [f"{cfg.ranks} ranks{where} for {', '.join(launched)}"] if launched else []
    said += [f"an mpirun job of {cfg.ranks} for mpi"] if "mpi" in systems else []
    return f"starting {' and '.join(said)}; each row is checked against the reference as it opens"


class Lines:
    """Progress as lines on stderr, where no bar can be drawn: per batch size, what its start-up
    starts, each row as it is ready (the slowest to start, MPI's, comes last), the first timed
    round, and one line per system with its result, each with the seconds since the start."""

    def __init__(self, cfg: BenchConfig, systems: tuple[str, ...]):
        self._cfg, self._systems, self._start = cfg, systems, time.monotonic()
        self._tokens, self._rounds = 0, 0

    def _say(self, text: str) -> None:
        print(f"ubep bench: {self._tokens} tokens/rank: {text} ({time.monotonic() - self._start:.0f} s)",
              file=sys.stderr, flush=True)  # fmt: skip

    def starting(self, tokens: int) -> None:
        self._tokens, self._rounds = tokens, 0
        self._say(starting_what(self._cfg, self._systems))

    def opened(self, system: str) -> None:
        self._say(f"{system} ready (open, and checked against the reference)")

    def advance(self) -> None:
        self._rounds += 1
        if self._rounds == 1:
            rounds = self._cfg.warmup + self._cfg.iters
            self._say(f"every row ready; round 1 of {rounds} done ({self._cfg.warmup} warm-up)")

    def measured(self, rows: list[report.Row]) -> None:
        for row in rows:
            self._say(f"{row.system}: dispatch {row.dispatch_us:.1f} us, combine {row.combine_us:.1f} us")


class Bar:
    """Progress as a bar on a terminal: its text says what is starting and which rows are ready,
    then which rounds run; a context manager (the bar is drawn while it is open)."""

    def __init__(self, cfg: BenchConfig, systems: tuple[str, ...]):
        self._cfg, self._systems, self._ready = cfg, systems, []
        self._bar = RichProgress(console=Console(stderr=True), transient=True)
        self._task = self._bar.add_task("benchmarking", total=len(cfg.tokens) * (cfg.warmup + cfg.iters))
        self._tokens = 0

    def __enter__(self) -> Bar:
        self._bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._bar.__exit__(*exc)

    def _show(self, text: str) -> None:
        self._bar.update(self._task, description=f"{self._tokens} tokens/rank: {text}")

    def starting(self, tokens: int) -> None:
        self._tokens, self._ready = tokens, []
        self._show(starting_what(self._cfg, self._systems).split(";")[0])

    def opened(self, system: str) -> None:
        self._ready.append(system)
        waiting = [s for s in self._systems if s not in self._ready]
        self._show(f"ready: {', '.join(self._ready)}; starting {', '.join(waiting)}" if waiting else "ready")

    def advance(self) -> None:
        self._show(f"rounds of {', '.join(self._systems)}")
        self._bar.advance(self._task)

    def measured(self, rows: list[report.Row]) -> None:
        pass  # the table follows

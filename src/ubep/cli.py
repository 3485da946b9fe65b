"""The `ubep` command line: `ubep bench` compares ubep with the alternatives on this host;
`ubep simulate` runs the same plans on a model of a superpod; `ubep decode` times a small
MoE model's decode steps under expert parallelism; `ubep report` reads a stats file
(`Stats.save`, `ubep bench --stats`) and names the straggler; `ubep warm` fills the numba
kernels' cache, so that no Buffer on this host compiles."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import tempfile
import time
import traceback
from dataclasses import asdict
from importlib.metadata import version
from typing import TYPE_CHECKING

from ubep.bench.decode import add_parser as add_decode
from ubep.bench.workload import ACROSS_SYSTEMS, ALL_SYSTEMS, DTYPES, RACK_SYSTEMS, SYSTEMS, BenchConfig
from ubep.extras import install_hint, require
from ubep.registry import NUMBA
from ubep.routing import ROUTINGS
from ubep.schedule import POLICIES
from ubep.sim.commands import add_parser as add_simulate
from ubep.sim.commands import add_plan_parser as add_plan

if TYPE_CHECKING:
    from ubep.bench.hosts import Link
    from ubep.bench.tiers import TierRow
    from ubep.sim.tiers import Stack

WARM_WAIT_S = 120.0  # `ubep warm`: how long another process's compile may show no progress


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _at_least(low: int):
    """An argparse type: an integer no smaller than `low`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def _systems(text: str) -> tuple[str, ...]:
    names = tuple(v for v in text.split(",") if v)
    unknown = [n for n in names if n not in ALL_SYSTEMS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown system(s) {unknown}; choose from {', '.join(ALL_SYSTEMS)}")
    return names


def _placements(text: str) -> tuple[str, ...]:
    from ubep.bench.placed import PLACEMENTS

    names = tuple(v for v in text.split(",") if v)
    if unknown := [n for n in names if n not in PLACEMENTS]:
        raise argparse.ArgumentTypeError(
            f"unknown placement(s) {unknown}; choose from {', '.join(PLACEMENTS)}"
        )
    return names


def add_bench(subparsers) -> None:
    d = BenchConfig()
    p = subparsers.add_parser(
        "bench",
        help="measure dispatch/combine of ubep and its peers on this host",
        description="Measure EP dispatch and combine on local ranks: ubep beside a BSP "
        "baseline, torch.distributed (gloo), MPI and the memcpy floor.",
    )
    p.add_argument(
        "--ranks", type=_at_least(2), default=d.ranks, help="local rank processes (default %(default)s)"
    )
    p.add_argument(
        "--tokens",
        type=_ints,
        default=d.tokens,
        help=f"tokens per rank; a comma list sweeps (default {','.join(map(str, d.tokens))})",
    )
    p.add_argument("--hidden", type=_at_least(1), default=d.hidden, help="hidden size (default %(default)s)")
    p.add_argument(
        "--experts", type=_at_least(1), default=d.experts, help="routed experts (default %(default)s)"
    )
    p.add_argument(
        "--topk", type=_at_least(1), default=d.topk, help="experts per token (default %(default)s)"
    )
    p.add_argument("--iters", type=_at_least(1), default=d.iters, help="timed rounds (default %(default)s)")
    p.add_argument(
        "--warmup", type=_at_least(0), default=d.warmup, help="untimed rounds first (default %(default)s)"
    )
    p.add_argument(
        "--routing", choices=ROUTINGS, default=d.routing, help="routing distribution (default %(default)s)"
    )
    p.add_argument(
        "--skew",
        type=float,
        default=d.skew,
        help="zipf exponent, or hot share for 'hot' (default %(default)s)",
    )
    p.add_argument(
        "--mode",
        choices=("normal", "ll"),
        default=d.mode,
        help="normal (high-throughput) or ll (low-latency: expert-major, weighted combine); default "
        "%(default)s",
    )
    p.add_argument(
        "--dtype", choices=tuple(DTYPES), default=d.dtype, help="token dtype (default %(default)s)"
    )
    p.add_argument(
        "--systems",
        type=_systems,
        help=f"comma list of {', '.join(ALL_SYSTEMS)} (default: {','.join(SYSTEMS)} on one node, "
        f"{','.join(ACROSS_SYSTEMS)} across nodes)",
    )
    p.add_argument(
        "--nodes",
        type=_at_least(1),
        default=d.nodes,
        help="emulate this many nodes (ranks split evenly; torch.distributed between them); default "
        "%(default)s",
    )
    p.add_argument(
        "--hosts",
        type=_at_least(2),
        metavar="N",
        help="N hosts on this machine (network namespaces, scripts/netns_hosts.sh) where root and "
        "`ip netns` allow, else N emulated nodes, saying why; ranks split evenly",
    )
    p.add_argument(
        "--link-rate",
        default=d.link_rate,
        metavar="RATE",
        help="the links between --hosts, in tc's units (1gbit, 2500mbit); the token bucket's burst is "
        "2 ms of it (default %(default)s)",
    )
    p.add_argument(
        "--racks",
        type=_at_least(1),
        default=d.racks,
        metavar="Q",
        help="the --hosts stand in Q racks (consecutive hosts; a bridge each), joined by uplinks at "
        "--rack-link-rate; the rows then are ubep-tiers (once per rack, then per host), ubep (per host), "
        "ubep-dist (flat) and hier-bsp, with the bytes on each tier and the simulator's time beside "
        "them (default %(default)s)",
    )
    p.add_argument(
        "--rack-link-rate",
        default=d.rack_link_rate,
        metavar="RATE",
        help="each rack's uplink with --racks, in tc's units; its token bucket's burst is 2 ms of it",
    )
    p.add_argument(
        "--workers",
        type=_at_least(1),
        default=d.workers,
        help="put workers per rank for the ubep row, following the token scheduler (default %(default)s)",
    )
    p.add_argument(
        "--schedule",
        choices=POLICIES,
        default=d.schedule,
        help="the scheduler's policy with several workers (distance, balanced, bsp, ...); default "
        "%(default)s",
    )
    p.add_argument(
        "--placement",
        type=_placements,
        default=d.placements,
        help="comma list of none, eplb, eplb-global, ubep: rows with experts placed (load-only EPLB, "
        "hierarchical or global / ubep's, by load and distance)",
    )
    p.add_argument("--redundant", type=_at_least(0), help="redundant expert slots of --placement rows (E/8)")
    p.add_argument(
        "--seed", type=int, default=d.seed, help="seed of the inputs and routing (default %(default)s)"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=d.timeout_s,
        help="per-wait deadline in seconds (default %(default)g)",
    )
    p.add_argument("--json", metavar="PATH", help="write results as JSON")
    p.add_argument("--plot", metavar="PATH.png", help="plot latency against tokens per rank")
    p.add_argument(
        "--profile",
        action="store_true",
        help="instead: where a row's CPU time goes, per category (the first Buffer row of --systems)",
    )
    p.add_argument(
        "--stats",
        metavar="PATH.json",
        nargs="?",
        const="ubep-stats.json",
        help="add the row ubep-stats (ubep recording stats, in the same rounds: its x ubep is the "
        "overhead), save its merged snapshot (default ubep-stats.json) and print the straggler report",
    )
    p.add_argument("--trace", metavar="PATH.json", help="write a Perfetto / Chrome trace of ubep-stats")
    p.add_argument(
        "--slow-rank",
        type=_at_least(0),
        default=-1,
        metavar="R",
        help="this rank sleeps before each call (default: none)",
    )
    p.add_argument(
        "--delay-us",
        type=float,
        default=0.0,
        metavar="D",
        help="how long the slow rank sleeps, in us (default 0)",
    )
    p.set_defaults(func=run_bench)


def _namespace_link(args: argparse.Namespace) -> Link | None:
    """The link between --hosts where namespace hosts can be made (saying so), else None (saying why:
    the bench then runs emulated nodes)."""
    from ubep.bench.hosts import link_of, namespaces_available

    found = namespaces_available()
    if not found.ok:
        said = f"no namespace hosts ({found.why}): {args.hosts} emulated nodes instead"
        print(f"ubep bench --hosts {args.hosts}: {said}")
        return None
    try:
        link = link_of(args.link_rate, found.netem, racks=args.racks, rack_rate=args.rack_link_rate)
    except ValueError as why:
        raise SystemExit(f"ubep bench --link-rate: {why}") from None
    print(f"ubep bench --hosts {args.hosts}: namespace hosts ({found.why})")
    return link


def run_bench(args: argparse.Namespace) -> int:
    require("ubep bench", "rich", "bench")
    if args.plot:
        require("ubep bench --plot", "matplotlib", "bench")
    from ubep.bench import report
    from ubep.bench.hosts import HostsFailedError
    from ubep.bench.run import plan, room_refused, run

    flag, args.nodes = ("--hosts", args.hosts) if args.hosts else ("--nodes", args.nodes)  # as typed
    if args.ranks % args.nodes:
        raise SystemExit(f"ubep bench: --ranks ({args.ranks}) must split evenly into {flag} ({args.nodes})")
    if args.experts % args.ranks:
        raise SystemExit(
            f"ubep bench: --experts ({args.experts}) must be a multiple of --ranks ({args.ranks})"
        )
    if args.racks > 1 and (args.nodes % args.racks or not args.rack_link_rate):
        raise SystemExit(
            f"ubep bench: --racks ({args.racks}) must divide {flag} ({args.nodes}), with --rack-link-rate"
        )
    if args.slow_rank >= args.ranks or args.delay_us < 0 or (args.slow_rank >= 0) != (args.delay_us > 0):
        raise SystemExit("ubep bench: --slow-rank R (below --ranks) and --delay-us D (> 0) go together")
    link = _namespace_link(args) if args.hosts else None  # what joins the hosts, for the notes and JSON
    namespaces = link is not None
    stats_path = args.stats or (_scratch_stats() if args.trace else "")
    cfg = BenchConfig(
        ranks=args.ranks,
        tokens=args.tokens,
        hidden=args.hidden,
        experts=args.experts,
        topk=args.topk,
        iters=args.iters,
        warmup=args.warmup,
        routing=args.routing,
        skew=args.skew,
        mode=args.mode,
        dtype=args.dtype,
        systems=args.systems or default_systems(args.nodes, args.racks),
        seed=args.seed,
        nodes=args.nodes,
        namespaces=namespaces,
        link_rate=args.link_rate,
        racks=args.racks,
        rack_link_rate=args.rack_link_rate,
        workers=args.workers,
        schedule=args.schedule,
        timeout_s=args.timeout,
        stats_path=stats_path,
        slow_rank=args.slow_rank,
        delay_us=args.delay_us,
        placements=args.placement,
        redundant=args.redundant,
    )
    if args.profile:
        from ubep.bench.profile import run_profile

        try:
            run_profile(cfg, cfg.tokens[0])
        except HostsFailedError as failed:
            raise SystemExit(f"ubep bench --hosts {args.hosts}: {failed.line()}") from None
        return 0
    try:
        systems, notes = plan(cfg)
    except ValueError as why:
        raise SystemExit(f"ubep bench: {why}") from None
    notes += [link.note(args.hosts)] if link else []
    title = report.title(cfg, os.cpu_count())
    notes.append(
        f"systems take turns, one dispatch + combine each per round, {cfg.iters} rounds after "
        f"{cfg.warmup} warm-up; latency: median over rounds of the slowest rank, from a common start "
        "instant; GB/s: token bytes each rank receives / latency; x ubep: median over rounds of "
        "(dispatch + combine), over ubep's, with a paired bootstrap interval over rounds"
    )
    meta, rows, batches = report.metadata(), [], 0
    if link:
        meta["link"] = link._asdict()  # what joined the namespace hosts: rate, burst, delay

    def save(complete: bool) -> None:
        if args.json:
            report.write_json(
                args.json, config=cfg.as_dict(), meta=meta, rows=rows, notes=notes, complete=complete
            )

    def measured(batch: list[report.Row]) -> None:  # a whole file after every batch size
        nonlocal batches
        rows.extend(batch)
        batches += 1
        save(complete=batches == len(cfg.tokens))

    try:
        run(cfg, systems, measured)
    except HostsFailedError as failed:  # the whole output is in its tail; one line says what went wrong
        raise SystemExit(f"ubep bench --hosts {args.hosts}: {failed.line()}") from None
    except Exception as error:
        if (said := room_refused(error)) is None:
            raise
        save(complete=False)
        raise SystemExit(f"ubep bench: {said}") from None
    except KeyboardInterrupt:  # keep what was measured: on disk (already) and on the screen
        notes.append(f"interrupted: {batches} of {len(cfg.tokens)} batch sizes measured")
        save(complete=False)
        if rows:
            report.print_table(rows, title + " (interrupted)", notes)
        else:
            print(notes[-1])
        return 130
    tiers = _tiers(cfg, rows, link) if cfg.racks > 1 else None
    if tiers is not None:  # beside the rows in the JSON: each row's bytes per tier, the simulator's time
        meta["tiers"] = [asdict(t) | {"gap": t.gap} for t in tiers[0]]
        save(complete=True)
    report.print_table(rows, title, notes)
    if tiers is not None:
        from ubep.bench.tiers import print_tiers

        print_tiers(*tiers)
    if any(p != "none" for p in cfg.placements):
        from ubep.bench.placed import print_stats
        from ubep.bench.workload import build

        print_stats(cfg, {t: build(cfg, t) for t in cfg.tokens}, rows)
    if args.plot:
        report.plot(args.plot, rows, title)
    if stats_path:
        _observed(stats_path, rows, args.trace, kept=bool(args.stats))
    return 0


def default_systems(nodes: int, racks: int) -> tuple[str, ...]:
    """The rows a run measures when --systems is not given: on one node, across nodes, across racks."""
    return RACK_SYSTEMS if racks > 1 else ACROSS_SYSTEMS if nodes > 1 else SYSTEMS


def _tiers(cfg: BenchConfig, rows, link: Link | None) -> tuple[list[TierRow], Stack]:
    """For a --racks run: each row's bytes on each tier and the simulator's time, on the stack of the
    links the hosts had (or would have had, where the nodes were emulated)."""
    from ubep.bench.hosts import link_of
    from ubep.bench.tiers import stack_of, tier_rows

    link = link or link_of(cfg.link_rate, False, racks=cfg.racks, rack_rate=cfg.rack_link_rate)
    stack = stack_of(cfg, link.bytes_per_s, link.rack_bytes_per_s)
    return tier_rows(cfg, rows, stack), stack


def _scratch_stats() -> str:
    """Where the ranks leave the snapshot when only a trace was asked for."""
    import tempfile

    return os.path.join(tempfile.mkdtemp(prefix="ubep-bench-stats-"), "stats.json")


def _observed(stats_path: str, rows, trace: str | None, kept: bool) -> None:
    """After a --stats run: the overhead of recording, the straggler report, the trace; `kept`: the
    snapshot was asked for (else it is scratch, for the trace alone)."""
    from ubep import observe
    from ubep.stats import Stats

    for row in rows:
        if row.system == "ubep-stats" and row.vs_ubep is not None:
            low, high = row.vs_ubep_ci95
            print(
                f"stats overhead at {row.tokens_per_rank} tokens/rank: ubep-stats / ubep = {row.vs_ubep:.3f} "
                f"(interval {low:.3f}-{high:.3f}), {(row.vs_ubep - 1) * 100:+.1f} % of call time"
            )
    if not os.path.exists(stats_path):
        return
    stats = Stats.load(stats_path)
    print(observe.stragglers(stats).text())
    if kept:
        print(f"wrote {stats_path}: the merged stats snapshot (ubep report reads it)")
    if trace:
        observe.write_trace(stats, trace)
        print(f"wrote {trace}: Perfetto / Chrome trace (open it in ui.perfetto.dev)")


def add_report(subparsers) -> None:
    p = subparsers.add_parser(
        "report",
        help="summarise a stats file and name the straggler",
        description="Read a merged stats snapshot (buf.stats(merge=True).save(path), or ubep bench "
        "--stats) and print its summary and straggler report; optionally export it. Given a bench "
        "results file (ubep bench --json), print its table again, with its date, host and command.",
    )
    p.add_argument("stats", metavar="STATS.json", help="the snapshot")
    p.add_argument("--trace", metavar="PATH.json", help="write a Perfetto / Chrome trace")
    p.add_argument(
        "--prometheus",
        metavar="PATH",
        help="write Prometheus text (needs prometheus_client: the observe extra)",
    )
    p.add_argument(
        "--heatmap",
        metavar="PATH.png",
        help="draw the traffic matrix and expert load (needs matplotlib: the observe extra)",
    )
    p.set_defaults(func=run_report)


def run_report(args: argparse.Namespace) -> int:
    """The summary and straggler report on stdout, then each export, one line per file written."""
    if args.prometheus:
        require("ubep report --prometheus", "prometheus_client", "observe")
    if args.heatmap:
        require("ubep report --heatmap", "matplotlib", "observe")
    from ubep import observe
    from ubep.stats import Stats

    if (bench := _bench_results(args.stats)) is not None:
        return _report_bench(args, bench)
    try:
        stats = Stats.load(args.stats)
    except (OSError, ValueError, KeyError) as why:
        raise SystemExit(f"ubep report: cannot read {args.stats}: {why}") from None
    print(stats.summary())
    print(observe.stragglers(stats).text() if stats.merged else "straggler report: needs a merged snapshot")
    if args.trace:
        observe.write_trace(stats, args.trace)
        print(f"wrote {args.trace}: Perfetto / Chrome trace (open it in ui.perfetto.dev)")
    if args.prometheus:
        with open(args.prometheus, "w") as out:
            out.write(observe.prometheus_text(stats))
        print(f"wrote {args.prometheus}: Prometheus text exposition")
    if args.heatmap:
        observe.write_heatmap(stats, args.heatmap)
        print(f"wrote {args.heatmap}: heatmap of the traffic matrix and expert load")
    return 0


def _bench_results(path: str) -> dict | None:
    """The file, parsed, where it is a bench results file (`ubep bench --json`); else None, and
    reading it as a stats file says what is wrong with it."""
    from ubep.bench.results import is_bench_results

    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError):
        return None
    return data if is_bench_results(data) else None


def _report_bench(args: argparse.Namespace, data: dict) -> int:
    """A bench results file: its table again, with when, where and by which command it was measured;
    the exports need a stats file."""
    said = f"ubep report: {args.stats} is a bench results file (ubep bench --json)"
    if args.trace or args.prometheus or args.heatmap:
        raise SystemExit(
            f"{said}: it holds timings, not stats; --trace, --prometheus and --heatmap read a stats file "
            "(ubep bench --stats, or Stats.save)"
        )
    if importlib.util.find_spec("rich") is None:
        raise SystemExit(
            f"{said}; ubep report reads stats files (written by ubep bench --stats), and shows a "
            f"bench results file's table with rich ({install_hint('bench')})"
        )
    from ubep.bench import report, results

    cfg = results.config_of(data)
    meta = data.get("meta", {})
    rows = [report.Row.from_dict(r) for r in data["results"]]
    measured = f"measured {meta.get('date', 'on an unrecorded date')}" + (
        f" on {results.host(data)}" if "host" in meta else ""
    )
    complete = "" if data.get("complete", True) else " (incomplete: the sweep stopped early)"
    cores = meta.get("host", {}).get("cores")
    notes = [*data.get("notes", []), f"{measured}{complete}: {results.command(cfg)}"]
    report.print_table(rows, report.title(cfg, cores), notes)
    return 0


def add_warm(subparsers) -> None:
    p = subparsers.add_parser(
        "warm",
        help="compile the numba kernels into their cache, once for this host",
        description="Compile (or load) every numba kernel and call half a Buffer can run, once for "
        "this host, so that no Buffer built later compiles (scripts/setup.sh runs this). A damaged "
        "cache file is named, removed and compiled again.",
    )
    p.add_argument(
        "--timeout",
        type=_seconds,
        default=WARM_WAIT_S,
        metavar="S",
        help="give up when another process holding the compile lock has shown no progress for S "
        "seconds (stopped or hung; default %(default)g)",
    )
    p.set_defaults(func=run_warm)


def _seconds(text: str) -> float:
    """An argparse type: a number of seconds, > 0 and finite."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0 and finite, got {text!r}")
    return value


def run_warm(args: argparse.Namespace) -> int:
    """One line: how many functions were compiled or loaded, where the cache lives, how long it took;
    before it, the lines that say what it waits for or repairs (the `ubep` logger's INFO lines)."""
    require("ubep warm", "numba", "fast")
    from ubep.engine.compile_once import cache_location, counting_compiles, kernel_stats
    from ubep.errors import CompileWaitTimeoutError, CorruptCacheError
    from ubep.factory import ready_engine

    _progress_lines("ubep warm")
    start = time.perf_counter()
    try:  # every warm-up: both protocols, both modes, and every kernel's example
        with counting_compiles() as compiled:
            ready_engine(NUMBA.name, deadline=time.monotonic() + args.timeout, examples=True)
    except CompileWaitTimeoutError as error:
        raise SystemExit(
            f"ubep warm: gave up after {error.waited_s:.0f} s: pid {error.holder} holds the compile lock "
            f"({error.lock}) and has shown no progress for {args.timeout:g} s (stopped or hung?); "
            "resume or end it, or raise --timeout"
        ) from None
    except CorruptCacheError as error:
        raise SystemExit(f"ubep warm: {error}") from None
    seconds, location = time.perf_counter() - start, cache_location()
    loaded = sum(hits for _, hits in kernel_stats().values())
    print(f"ubep warm: {warm_counts(compiled.entry, compiled.inner, loaded)}, cached in {location.path}"
          + (f" ({location.note})" if location.note else "") + f", {seconds:.1f} s")  # fmt: skip
    return 0


def warm_counts(compiled: int, inner: int, loaded: int) -> str:
    """The kernels `ubep warm` made ready, counted alike whether compiled or loaded: a kernel is a
    signature called from Python; those it calls are compiled inside it, and come with it from the
    cache, so they are named apart ("32 kernels compiled (and 69 functions inside them)")."""
    inside = f" (and {inner} functions inside them)" if inner else ""
    if not loaded:
        return f"{compiled} kernels compiled{inside}"
    if not compiled:
        return f"{loaded} kernels loaded from the cache"
    return f"{compiled + loaded} kernels: {compiled} compiled{inside}, {loaded} loaded from the cache"


def _progress_lines(command: str) -> None:
    """Show the `ubep` logger's INFO lines on stderr (a wait for another process's compile, a repair),
    prefixed by the command's name, unless UBEP_LOG_LEVEL or the application chose otherwise."""
    from ubep.settings import LOG_LEVEL_VARIABLE, LOGGER

    log = logging.getLogger(LOGGER)
    if os.environ.get(LOG_LEVEL_VARIABLE) or log.hasHandlers():
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"{command}: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)


def build_parser() -> argparse.ArgumentParser:
    """`ubep` and its commands, each with a description, every option with its help and default."""
    parser = argparse.ArgumentParser(prog="ubep", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('ubep')}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench(sub)
    add_simulate(sub)
    add_plan(sub)
    add_decode(sub)
    add_report(sub)
    add_warm(sub)
    for command in sub.choices.values():
        command.add_argument(
            "-v",
            "--verbose",
            action="store_true",
            help="on a failure, print the whole traceback (a failed rank's included) instead of one "
            "line naming the log file that holds it",
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "decode":
        _without_hub_progress_bars()
    if args.verbose:
        return args.func(args)
    try:
        return args.func(args)
    except Exception as error:  # a rank's failure arrives as a nested traceback of 50 lines or more
        raise SystemExit(failure_line(f"ubep {args.command}", error)) from None


def failure_line(command: str, error: Exception) -> str:
    """One line for a command that failed: what failed (for a rank, the last line of its traceback)
    and the log file, written here, that holds the whole traceback."""
    fd, path = tempfile.mkstemp(prefix=f"{command.replace(' ', '-')}-", suffix=".log")
    with os.fdopen(fd, "w") as log:
        log.write("".join(traceback.format_exception(error)))
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [""]
    if len(lines) == 1:  # "TimeoutError: 2 rank(s) of mpi not set up after 480 s"
        what = f"{type(error).__name__}: {lines[0]}"
    else:  # "rank 3 failed:" and its traceback: "rank 3 failed: ValueError: ..."
        what = f"{lines[0].rstrip(':')}: {lines[-1]}"
    return f"{command}: {what} (the whole traceback: {path}; --verbose prints it instead)"


def _without_hub_progress_bars() -> None:
    """`ubep decode` saves a model and loads it in every rank process: without this, transformers
    draws a progress bar per load (24 in a default run) on the table's terminal, and tqdm's
    lock in each rank leaks a semaphore at exit. Hugging Face's own switch is an environment
    variable, which also reaches the rank processes; a value the user set is kept."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

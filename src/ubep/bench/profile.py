"""`ubep bench --profile`: where one rank's CPU time goes in a Buffer row's dispatch and combine
(the first of --systems that is one: ubep by default; across --nodes also hier-bsp, ubep-nixl), in
normal mode or, with --mode ll, low-latency mode.

Two views, each from a Buffer of its own:

- the call timers (`ubep.timers`): dispatch + combine pairs back to back, no profiler, each
  block's wall and CPU time per call, and the sleeps, rings, yields and context switches per
  call; the median over ranks of each rank's mean per call;
- cProfile on the process CPU clock (so time spent preempted by the other ranks is not charged
  to anything), the functions grouped into what a reader cares about: row copies, the combine
  reduction, waiting (yields and doorbell sleeps), other torch ops, and Python itself. The
  profiler inflates Python (each call it sees costs it about a microsecond); the timers do not.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import statistics
import time
from collections.abc import Callable

import torch.distributed as dist
from rich.console import Console
from rich.table import Table

import ubep
from ubep.bench.hosts import profile_on_hosts
from ubep.bench.torch_systems import BUFFER_SYSTEMS
from ubep.bench.workload import UBEP_ROW, BenchConfig, build
from ubep.launcher import LocalLaunch
from ubep.registry import NIXL
from ubep.timers import BLOCKS, COUNTS, TIMED_KINDS

# what each of the timers' counts is called in the table
COUNT_LABELS = {
    "entries": "half entries",
    "sleeps": "doorbell sleeps",
    "rings": "rings sent",
    "yields": "yields (Python)",
    "switches_voluntary": "switches, blocked",
    "switches_involuntary": "switches, preempted",
}
CATEGORIES = (
    ("compiled halves", ("_halves.py:",)),  # each moves rows and waits (spins, yields) in one call
    ("row copies", ("index_select", "copy_")),
    ("combine reduction", ("built-in method torch.mm", "index_add_")),
    ("waiting", ("sched_yield", "select.select", "time.sleep", "posix.sched_yield")),
    ("torch.distributed (gloo)", ("c10d",)),  # collectives, sends and receives, and waits on them
    ("other torch ops", ("torch", "TensorBase")),
)


def category(func: tuple[str, int, str]) -> str:
    filename, _, name = func
    label = f"{filename}:{name}"
    for cat, needles in CATEGORIES:
        if any(n in label for n in needles):
            return cat
    return "python"


def _buffer(cfg: BenchConfig, tokens: int, name: str, call_timers: bool) -> ubep.Buffer:
    """The Buffer of row `name` (a `BUFFER_SYSTEMS` key) for `tokens` tokens per rank."""
    system = BUFFER_SYSTEMS[name]
    if system.fabric == NIXL.name:
        os.environ.setdefault("UCX_TLS", "tcp")  # as the bench's row (torch_systems.measure_rank)
        os.environ.setdefault("UCX_MODULES", "^efa")
    return ubep.Buffer(
        hidden=cfg.hidden,
        num_experts=cfg.experts,
        max_tokens_per_rank=tokens,
        max_topk=cfg.topk,
        protocol=system.protocol,
        transport=system.transport_for(cfg),
        fabric=system.fabric,
        low_latency=cfg.mode == "ll",  # slots only for that mode (128 tokens, 8 ranks: GBs)
        call_timers=call_timers,
    )


def _pair(buf: ubep.Buffer, cfg: BenchConfig, x, idx, w) -> None:
    """One dispatch and the combine of its rows, in cfg.mode, as a model's layer calls them."""
    if cfg.mode == "ll":
        got = buf.low_latency_dispatch(x, idx, x.shape[0], cfg.experts)
        buf.low_latency_combine(got.recv_x, idx, w, got.handle)
    else:
        got = buf.dispatch(x, topk_idx=idx, topk_weights=w)
        buf.combine(got.recv_x, got.handle)


def _calls(
    buf: ubep.Buffer, cfg: BenchConfig, x, idx, w
) -> tuple[Callable[[], object], Callable[[], object]]:
    """(dispatch, combine) of `buf` in cfg.mode on this rank's inputs, each to repeat alone: the
    combine returns the rows of one dispatch made here."""
    if cfg.mode == "ll":
        T = x.shape[0]
        got = buf.low_latency_dispatch(x, idx, T, cfg.experts)
        return (
            lambda: buf.low_latency_dispatch(x, idx, T, cfg.experts),
            lambda: buf.low_latency_combine(got.recv_x, idx, w, got.handle),
        )
    got = buf.dispatch(x, topk_idx=idx, topk_weights=w)
    return lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w), lambda: buf.combine(got.recv_x, got.handle)


def profile_rank(cfg: BenchConfig, tokens: int, calls: int, name: str) -> dict:
    """CPU seconds per category for `calls` dispatches and combines on this rank, and the wall time;
    under "timers", the call timers' per-call figures of `calls` pairs (`CallTimers.per_call`)."""
    me = dist.get_rank()
    work = build(cfg, tokens)
    x, idx, w = work.xs[me], work.topk_idx[me], work.topk_weights[me]
    out = {}
    with _buffer(cfg, tokens, name, call_timers=True) as buf:
        for i in range(cfg.warmup + calls):
            if i == cfg.warmup:
                dist.barrier()
                buf.call_timers.reset()
            _pair(buf, cfg, x, idx, w)
        out["timers"] = {kind: t for kind, t in buf.call_timers.per_call().items() if t}
    with _buffer(cfg, tokens, name, call_timers=False) as buf:
        ops = dict(zip(("dispatch", "combine"), _calls(buf, cfg, x, idx, w), strict=True))
        for op, fn in ops.items():
            for _ in range(cfg.warmup):
                fn()
            dist.barrier()
            prof, start = cProfile.Profile(time.process_time), time.perf_counter()
            prof.enable()
            for _ in range(calls):
                fn()
            prof.disable()
            wall = time.perf_counter() - start
            by_cat: dict[str, float] = {}
            for func, (_, _, tottime, _, _) in pstats.Stats(prof).stats.items():
                by_cat[category(func)] = by_cat.get(category(func), 0.0) + tottime
            out[op] = {"categories": by_cat, "wall_s": wall}
    return out


def timer_table(per_rank: list[dict], title: str) -> Table:
    """The call timers of every rank (`profile_rank`'s "timers") as one table: per block, wall and CPU
    microseconds per call, then the counts per call (`COUNT_LABELS`); each the median over ranks of
    the rank's mean."""
    table = Table(title=title)
    table.add_column("block", justify="left")
    kinds = [kind for kind in TIMED_KINDS if kind in per_rank[0]["timers"]]  # the kinds the calls had
    for kind in kinds:
        table.add_column(f"{kind} wall us", justify="right")
        table.add_column(f"{kind} CPU us", justify="right")

    def median(kind: str, keys: list[str]) -> float:
        return statistics.median(sum(rank["timers"][kind][k] for k in keys) for rank in per_rank)

    for block in (*BLOCKS, "total"):
        cells = []
        for kind in kinds:
            for clock in ("wall", "cpu"):
                keys = [f"{clock} {b}" for b in BLOCKS] if block == "total" else [f"{clock} {block}"]
                cells.append(f"{median(kind, keys):,.1f}")
        table.add_row(f"[bold]{block}[/bold]" if block == "total" else block, *cells)
    for count in COUNTS:
        cells = [cell for kind in kinds for cell in (f"{median(kind, [count]):.2f}", "")]
        table.add_row(f"{COUNT_LABELS[count]} / call", *cells)
    return table


def run_profile(cfg: BenchConfig, tokens: int) -> None:
    """Profile the first Buffer row of cfg.systems on every rank: on namespace hosts where
    cfg.namespaces, else on emulated nodes where cfg.nodes > 1."""
    name = next((s for s in cfg.systems if s in BUFFER_SYSTEMS), UBEP_ROW)
    calls = max(cfg.iters, 5)
    if cfg.namespaces:
        per_rank = profile_on_hosts(cfg, tokens, calls, name)
    else:
        launch = LocalLaunch(
            world_size=cfg.ranks, timeout_s=cfg.timeout_s * 4, ranks_per_node=cfg.ranks // cfg.nodes
        )
        per_rank = launch.run(profile_rank, cfg, tokens, calls, name)
    console = Console()
    where = (
        f"{cfg.nodes} {'namespace hosts' if cfg.namespaces else 'emulated nodes'}, " if cfg.nodes > 1 else ""
    )
    console.print(
        timer_table(
            per_rank,
            f"{name}: call timers, {calls} {cfg.mode}-mode dispatch + combine pairs, median over "
            f"{cfg.ranks} ranks of each rank's mean per call ({where}{tokens} tokens/rank; no profiler)",
        )
    )
    for op in ("dispatch", "combine"):
        table = Table(
            title=f"{name} {cfg.mode}-mode {op}: CPU time per call, mean over {cfg.ranks} ranks "
            f"({tokens} tokens/rank)"
        )
        for col in ("where", "us per call", "share"):
            table.add_column(col, justify="left" if col == "where" else "right")
        totals: dict[str, float] = {}
        for rank in per_rank:
            for cat, secs in rank[op]["categories"].items():
                totals[cat] = totals.get(cat, 0.0) + secs / calls / len(per_rank)
        cpu = sum(totals.values())
        for cat, secs in sorted(totals.items(), key=lambda kv: -kv[1]):
            table.add_row(cat, f"{secs * 1e6:,.0f}", f"{secs / cpu:.0%}")
        wall = max(rank[op]["wall_s"] for rank in per_rank) / calls
        table.add_row("[bold]CPU per rank[/bold]", f"{cpu * 1e6:,.0f}", "")
        table.add_row(
            "wall per call (slowest rank)", f"{wall * 1e6:,.0f}", f"{cpu * cfg.ranks / wall:.1f} cores"
        )
        console.print(table)

"""`ubep bench --profile`: where one rank's CPU time goes in a Buffer row's dispatch and combine
(the first of --systems that is one: ubep by default; across --nodes also hier-bsp, ubep-nixl).

Every rank profiles its own calls with cProfile on the process CPU clock (so
time spent preempted by the other ranks is not charged to anything), and the
functions are grouped into what a reader cares about: row copies, the
combine reduction, waiting (yields and doorbell sleeps), other torch ops,
and Python itself.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import time

import torch.distributed as dist
from rich.console import Console
from rich.table import Table

import ubep
from ubep.bench.torch_systems import BUFFER_SYSTEMS
from ubep.bench.workload import BenchConfig, build
from ubep.launcher import LocalLaunch

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


def profile_rank(cfg: BenchConfig, tokens: int, calls: int, name: str) -> dict:
    """CPU seconds per category for `calls` dispatches and combines on this rank, and the wall time."""
    me = dist.get_rank()
    work = build(cfg, tokens)
    x, idx, w = work.xs[me], work.topk_idx[me], work.topk_weights[me]
    system, out = BUFFER_SYSTEMS[name], {}
    if system.fabric == "nixl":
        os.environ.setdefault("UCX_TLS", "tcp")  # as the bench's row (torch_systems.measure_rank)
        os.environ.setdefault("UCX_MODULES", "^efa")
    with ubep.Buffer(
        hidden=cfg.hidden,
        num_experts=cfg.experts,
        max_tokens_per_rank=tokens,
        max_topk=cfg.topk,
        protocol=system.protocol,
        transport=system.across if cfg.nodes > 1 else system.transport,
        fabric=system.fabric,
    ) as buf:
        got = buf.dispatch(x, topk_idx=idx, topk_weights=w)
        ops = {
            "dispatch": lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w),
            "combine": lambda: buf.combine(got.recv_x, got.handle),
        }
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


def run_profile(cfg: BenchConfig, tokens: int) -> None:
    """Profile the first Buffer row of cfg.systems on every rank (emulated nodes where cfg.nodes > 1)."""
    name = next((s for s in cfg.systems if s in BUFFER_SYSTEMS), "ubep")
    calls = max(cfg.iters, 5)
    launch = LocalLaunch(
        world_size=cfg.ranks, timeout_s=cfg.timeout_s * 4, ranks_per_node=cfg.ranks // cfg.nodes
    )
    per_rank = launch.run(profile_rank, cfg, tokens, calls, name)
    console = Console()
    for op in ("dispatch", "combine"):
        table = Table(
            title=f"{name} {op}: CPU time per call, mean over {cfg.ranks} ranks ({tokens} tokens/rank)"
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

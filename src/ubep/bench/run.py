"""Running the benchmark: one launch per batch size, every system in it, then the report."""

from __future__ import annotations

from rich.progress import Progress

from ubep.bench import mpi_system, report
from ubep.bench.timing import Stats
from ubep.bench.torch_systems import measure_rank
from ubep.bench.workload import BenchConfig, build
from ubep.launcher import LocalLaunch


def stats_from_ranks(per_rank: list[dict], system: str, op: str) -> Stats:
    starts = per_rank[0][system][op][0]
    return Stats.of(starts, [r[system][op][1] for r in per_rank])


def run(cfg: BenchConfig) -> tuple[list[report.Row], list[str]]:
    """Measure every system at every batch size; returns rows (with ratios) and notes."""
    notes = []
    systems = list(cfg.systems)
    if "mpi" in systems:
        ok, why = mpi_system.available()
        if not ok:
            systems.remove("mpi")
            notes.append(f"mpi row skipped: {why}")
    in_launcher = tuple(s for s in systems if s != "mpi")
    rows = []
    with Progress(transient=True) as progress:
        task = progress.add_task("benchmarking", total=len(cfg.tokens) * len(systems))
        for tokens in cfg.tokens:
            nbytes = build(cfg, tokens).bytes_per_rank()
            progress.update(task, description=f"{tokens} tokens/rank: {', '.join(in_launcher)}")
            per_rank = LocalLaunch(world_size=cfg.ranks, timeout_s=cfg.timeout_s * 4).run(
                measure_rank, cfg, tokens, in_launcher
            )
            for system in in_launcher:
                d, c = (stats_from_ranks(per_rank, system, op) for op in ("dispatch", "combine"))
                rows.append(report.Row.build(system, cfg.mode, tokens, nbytes, d, c))
                progress.advance(task)
            if "mpi" in systems:
                progress.update(task, description=f"{tokens} tokens/rank: mpi")
                got = mpi_system.run_mpi(cfg, tokens)
                d, c = (Stats.of(got[op][0], got[op][1]) for op in ("dispatch", "combine"))
                rows.append(report.Row.build("mpi", cfg.mode, tokens, nbytes, d, c))
                progress.advance(task)
    return report.with_ratios(rows), notes

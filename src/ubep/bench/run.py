"""Running the benchmark: one launch per batch size, every system in it, then the report."""

from __future__ import annotations

from dataclasses import replace

from rich.progress import Progress

from ubep.bench import mpi_system, report
from ubep.bench.timing import Stats
from ubep.bench.torch_systems import measure_rank
from ubep.bench.workload import BenchConfig, build
from ubep.engine import choose_engine
from ubep.launcher import LocalLaunch
from ubep.layout import ExpertPlacement
from ubep.protocols.hier import boundary_bytes


def stats_from_ranks(per_rank: list[dict], system: str, op: str) -> Stats:
    starts = per_rank[0][system][op][0]
    return Stats.of(starts, [r[system][op][1] for r in per_rank])


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

    return {"ubep": mean("dedup"), "bsp-gloo": mean("flat")}


def run(cfg: BenchConfig) -> tuple[list[report.Row], list[str]]:
    """Measure every system at every batch size; returns rows (with ratios) and notes."""
    engine, why = choose_engine("auto")  # compiles (or loads) the kernels once, before the ranks start
    notes = [f"engine: {engine.name} ({why})"]
    systems = list(cfg.systems)
    if cfg.nodes > 1:
        single_host = [s for s in systems if s in ("bsp-shm", "mpi")]
        systems = [s for s in systems if s not in single_host]
        notes.append(
            f"{cfg.nodes} emulated nodes of {cfg.ranks // cfg.nodes} ranks: ubep runs the hierarchical "
            "transport (one crossing per token and node), bsp-gloo the flat all-to-all"
            + (f"; no {', '.join(single_host)} row (one host only)" if single_host else "")
        )
    if cfg.mode == "ll":
        unsupported = [s for s in systems if s in ("bsp-shm", "mpi")]
        systems = [s for s in systems if s not in unsupported]
        if unsupported:
            notes.append(
                f"ll mode: no {', '.join(unsupported)} row (low-latency mode is ubep's protocol on "
                "shared memory, or the collective path, shown as bsp-gloo)"
            )
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
            nbytes = build(cfg, tokens).bytes_per_rank(cfg.mode)
            progress.update(task, description=f"{tokens} tokens/rank: {', '.join(in_launcher)}")
            launch = LocalLaunch(
                world_size=cfg.ranks, timeout_s=cfg.timeout_s * 4, ranks_per_node=cfg.ranks // cfg.nodes
            )
            per_rank = launch.run(measure_rank, cfg, tokens, in_launcher)
            crossing = boundary_per_rank(cfg, tokens)
            for system in in_launcher:
                d, c = (stats_from_ranks(per_rank, system, op) for op in ("dispatch", "combine"))
                row = report.Row.build(system, cfg.mode, tokens, nbytes, d, c)
                rows.append(replace(row, boundary_bytes=crossing.get(system)))
                progress.advance(task)
            if "mpi" in systems:
                progress.update(task, description=f"{tokens} tokens/rank: mpi")
                got = mpi_system.run_mpi(cfg, tokens)
                d, c = (Stats.of(got[op][0], got[op][1]) for op in ("dispatch", "combine"))
                rows.append(report.Row.build("mpi", cfg.mode, tokens, nbytes, d, c))
                progress.advance(task)
    return report.with_ratios(rows), notes

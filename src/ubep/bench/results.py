"""Bench results files (`ubep bench --json`): knowing one, the command that measured it, and the
table of the newest numbers that opens docs/benchmarks.md (`scripts/results_table.py` writes it).

    docs/results/*.json -> dated, complete bench files -> grouped by command
                        -> per command, the runs of its newest day -> one table row per batch size

It reads the files as plain JSON (no rich, no rank processes).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path

from ubep.bench.workload import ACROSS_SYSTEMS, RACK_SYSTEMS, ROWS, SYSTEMS, UBEP_ROW, BenchConfig
from ubep.schedule import policy_name

# The flags `command` writes, in the order `ubep bench --help` lists them, for fields set alike
# on every run (the rest: nodes, systems, schedule, stats, a slow rank and placements, below).
FLAGS = (
    ("ranks", "--ranks"),
    ("tokens", "--tokens"),
    ("hidden", "--hidden"),
    ("experts", "--experts"),
    ("topk", "--topk"),
    ("iters", "--iters"),
    ("warmup", "--warmup"),
    ("routing", "--routing"),
    ("mode", "--mode"),
    ("dtype", "--dtype"),
    ("workers", "--workers"),
    ("seed", "--seed"),
    ("timeout_s", "--timeout"),
)
BEGIN, END = "<!-- results table: begin -->", "<!-- results table: end -->"  # its place in the doc


def is_bench_results(data: object) -> bool:
    """Whether `data` (a parsed JSON file) is what `ubep bench --json` writes."""
    if not isinstance(data, dict) or not isinstance(data.get("config"), dict):
        return False
    results = data.get("results")
    return isinstance(results, list) and all(
        isinstance(r, dict) and "system" in r and "dispatch_us" in r for r in results
    )


def config_of(data: dict) -> BenchConfig:
    """The run's configuration; fields a file of another version lacks take today's defaults, and
    fields it has that no longer exist are left out."""
    known = {f.name for f in fields(BenchConfig)}
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in data["config"].items() if k in known}
    return BenchConfig(**given)


def _text(value: object) -> str:
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return f"{value:g}" if isinstance(value, float) else str(value)


def command(cfg: BenchConfig) -> str:
    """The `ubep bench` command that measures `cfg`: a flag for each setting that differs from its
    default (outputs such as --json left out; --stats without its path)."""
    default, said = BenchConfig(), ["ubep", "bench"]
    for name, flag in FLAGS:
        if (value := getattr(cfg, name)) != getattr(default, name):
            said += [flag, _text(value)]
    if cfg.routing != default.routing and cfg.skew != default.skew:
        said += ["--skew", _text(cfg.skew)]
    if cfg.workers > 1 and policy_name(cfg.schedule) != default.schedule:
        said += ["--schedule", policy_name(cfg.schedule)]
    if cfg.nodes > 1:
        said += ["--hosts" if cfg.namespaces else "--nodes", str(cfg.nodes)]
    if cfg.namespaces and cfg.link_rate != default.link_rate:
        said += ["--link-rate", cfg.link_rate]
    if cfg.racks > 1:
        said += ["--racks", str(cfg.racks), "--rack-link-rate", cfg.rack_link_rate]
    if cfg.systems != (RACK_SYSTEMS if cfg.racks > 1 else ACROSS_SYSTEMS if cfg.nodes > 1 else SYSTEMS):
        said += ["--systems", _text(cfg.systems)]
    if cfg.placements:
        said += ["--placement", _text(cfg.placements)]
    if cfg.redundant is not None:
        said += ["--redundant", str(cfg.redundant)]
    if cfg.stats_path:
        said.append("--stats")
    if cfg.slow_rank >= 0:
        said += ["--slow-rank", str(cfg.slow_rank), "--delay-us", _text(cfg.delay_us)]
    return " ".join(said)


def host(data: dict) -> str:
    """ "AMD EPYC, 2 cores": the CPU model and core count the file records."""
    about = data["meta"]["host"]
    return f"{about['cpu']}, {about['cores']} cores"


@dataclass(frozen=True, slots=True)
class Runs:
    """The runs of one command on its newest day: their files, parsed, oldest first."""

    command: str
    files: tuple[dict, ...]

    @property
    def date(self) -> str:
        return self.files[-1]["meta"]["date"][:10]

    def systems(self) -> list[str]:
        present = {r["system"] for data in self.files for r in data["results"]}
        return [s for s in ROWS if s in present]

    def tokens(self) -> list[int]:
        return sorted({r["tokens_per_rank"] for data in self.files for r in data["results"]})

    def _each(self, system: str, tokens: int) -> list[dict]:
        return [
            r
            for data in self.files
            for r in data["results"]
            if r["system"] == system and r["tokens_per_rank"] == tokens
        ]

    def ubep_us(self, tokens: int) -> float | None:
        """ubep's dispatch + combine: per run the median over rounds, then the median over runs."""
        rows = self._each(UBEP_ROW, tokens)
        if not rows:
            return None
        per_run = [
            statistics.median(map(sum, zip(r["dispatch_rounds_us"], r["combine_rounds_us"], strict=True)))
            if r.get("dispatch_rounds_us")
            else r["dispatch_us"] + r["combine_us"]
            for r in rows
        ]
        return statistics.median(per_run)

    def vs_ubep(self, system: str, tokens: int) -> float | None:
        """The median over runs of each run's "x ubep" for `system` (None where it has none)."""
        ratios = [r["vs_ubep"] for r in self._each(system, tokens) if r.get("vs_ubep") is not None]
        return statistics.median(ratios) if ratios else None


def newest_runs(files: Iterable[dict]) -> list[Runs]:
    """Per command, the complete, dated runs of its newest day on the newest run's host; the
    commands with the fewest flags first (the default run leads)."""
    by_command: dict[str, list[dict]] = {}
    for data in files:
        if is_bench_results(data) and data.get("complete") and "date" in data.get("meta", {}):
            by_command.setdefault(command(config_of(data)), []).append(data)
    groups = []
    for said, runs in by_command.items():
        runs.sort(key=lambda d: d["meta"]["date"])
        newest = runs[-1]
        day, where = newest["meta"]["date"][:10], host(newest)
        same = [d for d in runs if d["meta"]["date"][:10] == day and host(d) == where]
        groups.append(Runs(said, tuple(same)))
    return sorted(groups, key=lambda g: (len(g.command.split()), g.command))  # the plainest first


def read_folder(folder: str | Path) -> list[dict]:
    """Every JSON file in `folder` that is a bench results file, parsed (others are skipped)."""
    found = []
    for path in sorted(Path(folder).glob("*.json")):
        data = json.loads(path.read_text())
        if is_bench_results(data):
            found.append(data)
    return found


def markdown(groups: list[Runs]) -> str:
    """The table: per command and batch size, ubep's dispatch + combine, and every other row's time
    over ubep's ("x ubep", below 1 faster), each the median over the day's runs."""
    systems = [s for s in ROWS if s != UBEP_ROW and any(s in g.systems() for g in groups)]
    head = ["command", "date (UTC)", "host", "runs", "tokens/rank", "ubep d+c (us)", *systems]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 4 + ["---:"] * (len(head) - 4)) + "|"]
    for g in groups:
        for tokens in g.tokens():
            ubep_us = g.ubep_us(tokens)
            ratios = [g.vs_ubep(s, tokens) for s in systems]
            cells = [f"`{g.command}`", g.date, host(g.files[-1]), str(len(g.files)), str(tokens)]
            cells.append("" if ubep_us is None else f"{ubep_us:,.0f}")
            cells += ["" if r is None else f"{r:.2f}" for r in ratios]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)

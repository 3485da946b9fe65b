"""Turning timings into rows, a terminal table, JSON and a plot."""

from __future__ import annotations

import json
import os
import platform
import statistics
from dataclasses import asdict, dataclass, fields, replace
from datetime import UTC, datetime

import torch
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

import ubep
from ubep.bench.ratio import LEVEL, paired_ratio
from ubep.bench.timing import Stats
from ubep.bench.workload import UBEP_ROW, BenchConfig


@dataclass(frozen=True, slots=True)
class Row:
    """One system at one batch size: latencies in microseconds, bandwidth in GB/s."""

    system: str
    mode: str
    tokens_per_rank: int
    dispatch_us: float  # median over rounds
    combine_us: float
    dispatch_p99_us: float
    combine_p99_us: float
    bytes_per_rank: float
    dispatch_gbps: float
    combine_gbps: float
    vs_ubep: float | None = None  # median over rounds of (dispatch + combine), this system's / ubep's
    vs_ubep_ci95: tuple[float, float] | None = None  # paired bootstrap over rounds (see ratio)
    vs_hier_bsp: float | None = None  # the same over hier-bsp's (the collective path across nodes)
    vs_hier_bsp_ci95: tuple[float, float] | None = None
    floor_fraction: float | None = None  # floor time / this system's time (medians over rounds)
    boundary_bytes: float | None = None  # per rank and call, dispatch + combine, across emulated nodes
    dispatch_rounds_us: tuple[float, ...] = ()  # every timed round, in the order run
    combine_rounds_us: tuple[float, ...] = ()

    @classmethod
    def build(
        cls,
        system: str,
        mode: str,
        tokens: int,
        nbytes: float,
        dispatch_us: list[float],
        combine_us: list[float],
    ) -> Row:
        d, c = Stats.of(dispatch_us), Stats.of(combine_us)
        return cls(
            system,
            mode,
            tokens,
            d.median_us,
            c.median_us,
            d.p99_us,
            c.p99_us,
            nbytes,
            nbytes / d.median_us / 1e3,
            nbytes / c.median_us / 1e3,
            dispatch_rounds_us=tuple(dispatch_us),
            combine_rounds_us=tuple(combine_us),
        )

    @classmethod
    def from_dict(cls, row: dict) -> Row:
        """A row as `write_json` wrote it (lists back to tuples; fields of other versions left out)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in row.items() if k in known})

    @property
    def rounds_us(self) -> list[float]:
        """Dispatch + combine, round by round."""
        return [d + c for d, c in zip(self.dispatch_rounds_us, self.combine_rounds_us, strict=True)]


def title(cfg: BenchConfig, cores: int | None) -> str:
    """The table's title: the mode, the ranks on how many cores, the shape, the routing, the nodes."""
    where = "namespace hosts" if cfg.namespaces else "emulated nodes"
    return (
        f"{cfg.mode} mode, {cfg.ranks} ranks on {cores} cores, hidden {cfg.hidden}, "
        f"{cfg.experts} experts, top-{cfg.topk}, {cfg.dtype}, {cfg.routing} routing"
        + (f", {cfg.nodes} {where}" if cfg.nodes > 1 else "")
    )


def with_ratios(rows: list[Row]) -> list[Row]:
    """Fill in the ratios to ubep and to hier-bsp (each with its interval) and the fraction of the
    floor, per batch size."""
    out = []
    for row in rows:
        peers = {r.system: r for r in rows if r.tokens_per_rank == row.tokens_per_rank and r.mode == row.mode}
        ubep_row, hier_row, floor = peers.get(UBEP_ROW), peers.get("hier-bsp"), peers.get("memcpy-floor")
        if ubep_row is not None:
            vs = paired_ratio(row.rounds_us, ubep_row.rounds_us)
            row = replace(row, vs_ubep=vs.point, vs_ubep_ci95=(vs.low, vs.high))
        if hier_row is not None:
            vs = paired_ratio(row.rounds_us, hier_row.rounds_us)
            row = replace(row, vs_hier_bsp=vs.point, vs_hier_bsp_ci95=(vs.low, vs.high))
        if floor is not None:
            frac = statistics.median(floor.rounds_us) / statistics.median(row.rounds_us)
            row = replace(row, floor_fraction=frac)
        out.append(row)
    return out


WIDTH = 120  # the widest a table prints; past it the table is split in two, never cut
# Why a column shows "-" for a row: said under the table, or, where the whole column would be "-",
# instead of the column.
DASH = {
    "x ubep": "no ubep row at this batch size (it is the reference of the ratio)",
    "x hier-bsp": "no hier-bsp row at this batch size",
    "of floor": "no memcpy-floor row in this run: the floor is one host's memory copy, not a link, so "
    "it runs by default on one host only (add it with --systems)",
    "MB across nodes": "the row moves no token between nodes (the floor copies within a host)",
}
LATENCY = ("dispatch us", "p99", "combine us", "p99 ", "GB/s d/c")  # the first table of a split


def _columns(rows: list[Row]) -> list[tuple[str, list[str]]]:
    """(header, one cell per row) of every column the rows can fill."""
    return [
        ("system", [r.system for r in rows]),
        ("tokens", [str(r.tokens_per_rank) for r in rows]),
        ("dispatch us", [f"{r.dispatch_us:,.0f}" for r in rows]),
        ("p99", [f"{r.dispatch_p99_us:,.0f}" for r in rows]),
        ("combine us", [f"{r.combine_us:,.0f}" for r in rows]),
        ("p99 ", [f"{r.combine_p99_us:,.0f}" for r in rows]),
        ("GB/s d/c", [f"{r.dispatch_gbps:.2f}/{r.combine_gbps:.2f}" for r in rows]),
        ("x ubep", [_ratio(r.vs_ubep, r.vs_ubep_ci95) for r in rows]),
        ("x hier-bsp", [_ratio(r.vs_hier_bsp, r.vs_hier_bsp_ci95) for r in rows]),
        ("of floor", ["-" if r.floor_fraction is None else f"{r.floor_fraction:.0%}" for r in rows]),
        ("MB across nodes", ["-" if r.boundary_bytes is None else f"{r.boundary_bytes / 1e6:.2f}"
                             for r in rows]),
    ]  # fmt: skip


def tables(rows: list[Row], title: str, width: int = WIDTH) -> tuple[list[Table], list[str]]:
    """The rows as one table, or two (latencies, then ratios) where one would be wider than
    `width`; and a note for each "-" they show, saying why (a column of nothing but "-" is left out,
    its note said instead). Ratios carry their paired bootstrap interval in brackets."""
    columns, notes = [], []
    for header, cells in _columns(rows):
        dashes = cells.count("-")
        if header in DASH and dashes == len(cells):
            if header not in ("x hier-bsp", "MB across nodes"):  # those two exist across nodes only
                notes.append(f'no "{header}" column: {DASH[header]}')
            continue
        if dashes and header in DASH:
            notes.append(f'"-" in "{header}": {DASH[header]}')
        columns.append((header, cells))
    whole = _table(title, columns)
    if _width(whole) <= width:
        return [whole], notes
    key, latency = columns[:2], [c for c in columns if c[0] in LATENCY]
    rest = [c for c in columns[2:] if c[0] not in LATENCY]
    return [_table(title, key + latency), _table("the same rows, compared", key + rest)], notes


def _table(title: str, columns: list[tuple[str, list[str]]]) -> Table:
    t = Table(title=title)
    for header, _ in columns:
        label = header if header not in ("x ubep", "x hier-bsp") else f"{header} ({LEVEL:.0%} CI)"
        t.add_column(label.strip(), justify="left" if header == "system" else "right", no_wrap=True)
    for cells in zip(*(cells for _, cells in columns), strict=True):
        t.add_row(*cells)
    return t


def _width(t: Table) -> int:
    console = Console(width=1_000_000)
    return Measurement.get(console, console.options, t).maximum


def _ratio(value: float | None, ends: tuple[float, float] | None) -> str:
    """The point and its interval, "1.27 (1.11-1.59)" ("1.00" alone for the reference row)."""
    if value is None:
        return "-"
    if ends is None or ends[0] == ends[1] == value:
        return f"{value:.2f}"
    return f"{value:.2f} ({ends[0]:.2f}-{ends[1]:.2f})"


def print_table(rows: list[Row], title: str, notes: list[str]) -> None:
    """The table (or its two halves) with every cell whole, at most WIDTH columns wide, then the
    notes: the run's, and why any cell shows "-"."""
    shown, dashes = tables(rows, title)
    console = Console()
    widest = max(_width(t) for t in shown)
    console = Console(width=max(widest, min(console.width, WIDTH) if console.is_terminal else WIDTH))
    for t in shown:
        console.print(t)
    for note in [*notes, *dashes]:
        console.print(f"[dim]{note}[/dim]")


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name from /proc/cpuinfo (or the text `cpuinfo`), else what `platform` knows."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            return value.strip()
    return platform.processor() or "unknown"


def metadata() -> dict:
    """What the figures depend on beyond the config: versions, the host, and when (UTC)."""
    return {
        "ubep": ubep.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": {"cores": os.cpu_count(), "cpu": cpu_model(), "platform": platform.platform()},
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def write_json(
    path: str, *, config: dict, meta: dict, rows: list[Row], notes: list[str], complete: bool
) -> None:
    """Write the whole file under a temporary name, then rename it over `path`: a reader, or a
    sweep interrupted while writing, sees the previous version or this one, never half of one."""
    data = {
        "config": config,
        "meta": meta,
        "complete": complete,  # False: the sweep stopped (or is still running) before its last batch size
        "results": [asdict(r) for r in rows],
        "notes": notes,
    }
    partial = f"{path}.{os.getpid()}.tmp"
    try:
        with open(partial, "w") as f:
            json.dump(data, f, indent=2)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def plot(path: str, rows: list[Row], title: str) -> None:
    """Latency against tokens per rank, one line per system, dispatch and combine side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, op in zip(axes, ("dispatch", "combine"), strict=True):
        for system in dict.fromkeys(r.system for r in rows):
            mine = sorted((r for r in rows if r.system == system), key=lambda r: r.tokens_per_rank)
            ax.plot(
                [r.tokens_per_rank for r in mine],
                [getattr(r, f"{op}_us") for r in mine],
                marker="o",
                label=system,
            )
        ax.set_title(op)
        ax.set_xlabel("tokens per rank")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("latency (us, median, slowest rank)")
    axes[1].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

"""Beside `ubep bench --racks Q`'s rows: the bytes each row's schedule puts on each tier per call, and
the simulator's time for the same stack and sizes (`ubep.sim.tiers`), against the measurement.

    row          schedule   (ubep.sim.tiers)
    ubep-tiers   tiers      once per rack over the slow tier, then once per host
    ubep         hier       once per host (two tiers: the racks are not seen)
    ubep-dist    dist       every peer directly (flat)
    hier-bsp     hier       the same crossings as ubep, by rail all-to-alls
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ubep.bench.report import Row
from ubep.bench.workload import DTYPES, UBEP_ROW, BenchConfig, build
from ubep.layout import ExpertPlacement, token_in_rank
from ubep.registry import DIST, HIER, TIERS
from ubep.sim.tiers import Stack, predict_us, tier_bytes

SCHEDULE_OF_ROW = {
    "ubep-tiers": TIERS.name,
    UBEP_ROW: HIER.name,
    "ubep-dist": DIST.name,
    "hier-bsp": HIER.name,
}


@dataclass(frozen=True, slots=True)
class TierRow:
    """One row at one batch size: bytes per call (dispatch + combine, every rank) on each tier, the
    measured time (medians of dispatch and combine, us) and the simulator's."""

    system: str
    tokens_per_rank: int
    slow_bytes: int
    fast_bytes: int
    measured_us: float
    predicted_us: float

    @property
    def gap(self) -> float:
        """measured / predicted."""
        return self.measured_us / self.predicted_us if self.predicted_us else float("inf")


def stack_of(cfg: BenchConfig, link_bytes_per_s: int, rack_bytes_per_s: int) -> Stack:
    return Stack(
        racks=cfg.racks,
        hosts_per_rack=cfg.nodes // cfg.racks,
        ranks_per_host=cfg.ranks // cfg.nodes,
        link_gbps=link_bytes_per_s / 1e9,
        rack_gbps=rack_bytes_per_s / 1e9,
    )


def tier_rows(cfg: BenchConfig, rows: list[Row], stack: Stack) -> list[TierRow]:
    """A TierRow for every measured row that has a schedule here, at each batch size."""
    out, hits = [], {}
    itemsize = DTYPES[cfg.dtype].itemsize
    placement = ExpertPlacement.contiguous(cfg.experts, cfg.ranks)
    for row in rows:
        schedule = SCHEDULE_OF_ROW.get(row.system)
        if schedule is None:
            continue
        if row.tokens_per_rank not in hits:
            work = build(cfg, row.tokens_per_rank)
            hits[row.tokens_per_rank] = np.stack([token_in_rank(i, placement).numpy() for i in work.topk_idx])
        hit_RNR = hits[row.tokens_per_rank]
        nbytes = tier_bytes(schedule, stack, hit_RNR, cfg.hidden, itemsize, cfg.topk)
        dispatch, combine = predict_us(schedule, stack, hit_RNR, cfg.hidden, itemsize, cfg.topk)
        out.append(TierRow(row.system, row.tokens_per_rank, nbytes["slow"], nbytes["fast"],
                           row.dispatch_us + row.combine_us, dispatch + combine))  # fmt: skip
    return out


def print_tiers(tiers: list[TierRow], stack: Stack) -> None:
    """The table under the bench's: per row and batch size, MB per call on the slow tier (between
    racks) and the fast one (between hosts of a rack), the measured ms (medians of dispatch and
    combine), the simulator's, and how far apart they are (x sim: measured / simulated)."""
    from rich.console import Console
    from rich.table import Table

    title = (
        f"tiers per call, every rank: {stack.racks} racks of {stack.hosts_per_rack} hosts of "
        f"{stack.ranks_per_host} ranks, links {stack.link_gbps:g} GB/s, rack uplinks {stack.rack_gbps:g} GB/s"
    )
    table = Table(title=title)
    names = ("system", "tokens", "MB slow", "MB fast", "ms", "sim ms")
    for name in (*names, "x sim"):
        table.add_column(name, justify="left" if name == "system" else "right")
    for t in tiers:
        mb = (f"{t.slow_bytes / 1e6:.3f}", f"{t.fast_bytes / 1e6:.3f}")
        ms = (f"{t.measured_us / 1e3:.2f}", f"{t.predicted_us / 1e3:.2f}")
        table.add_row(t.system, str(t.tokens_per_rank), *mb, *ms, f"{t.gap:.2f}")
    Console().print(table)

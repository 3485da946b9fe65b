"""The straggler report: which rank held the others up most, by how much, in which half.

In each call every rank waits for the last one to begin sending. The last rank's lateness
is how long after the second-to-last it began: time the group lost to that rank alone (with
two ranks late together, neither alone is to blame). Summed over the recent calls of a merged
snapshot, the rank with the largest sum is the straggler; the evidence is its worst calls,
how often it came last, and the half (dispatch or combine) its lateness fell in.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from ubep.stats import Stats


@dataclass(frozen=True, slots=True)
class LateCall:
    """One call's last rank: `late_us` after the second-to-last began sending."""

    seq: int
    kind: str
    rank: int
    late_us: float
    waited_us: tuple[float, ...]  # how long each rank waited for it (0 for itself)


@dataclass(frozen=True, slots=True)
class StragglerReport:
    """The rank that held the others up most over the recent calls, with the evidence."""

    rank: int | None  # None: no call to judge (fewer than two ranks, or no recent calls)
    calls: int  # calls examined
    last_in: int  # calls in which `rank` was the last to begin
    total_us: float  # its lateness summed over those calls
    median_us: float  # its median lateness when last
    worst: LateCall | None
    half: str  # the kind of call holding most of its lateness
    total_us_R: tuple[float, ...]  # every rank's summed lateness
    evidence: tuple[LateCall, ...]  # its worst calls, worst first

    def text(self) -> str:
        if self.rank is None or self.worst is None:
            return "straggler report: no calls of two or more ranks to judge"
        share = self.total_us / max(sum(self.total_us_R), 1e-9)
        lines = [
            f"straggler: rank {self.rank} held the others up most: {self.total_us / 1e3:.2f} ms over "
            f"{self.calls} calls ({share:.0%} of all lateness), mostly in {self.half}",
            f"  last to begin in {self.last_in} of {self.calls} calls, by {self.median_us:.0f} us "
            f"(median); worst: call #{self.worst.seq} ({self.worst.kind}), {self.worst.late_us:.0f} us",
            "  lateness summed per rank (ms): "
            + ", ".join(f"{r}: {t / 1e3:.2f}" for r, t in enumerate(self.total_us_R)),
            "  worst calls (seq, kind, us late; what each rank waited for it, us):",
        ]
        for late in self.evidence:
            waits = " ".join(f"{w:.0f}" for w in late.waited_us)
            lines.append(f"    #{late.seq} {late.kind}: {late.late_us:.0f}  [{waits}]")
        return "\n".join(lines)


def late_calls(stats: Stats) -> list[LateCall]:
    """Every recent call of a merged snapshot: its last rank and by how much."""
    if not stats.merged:
        raise ValueError("the straggler report needs every rank's records: take buf.stats(merge=True)")
    out = []
    for seq, got in stats.calls_by_seq().items():
        ready = [got[r].ready_ns for r in range(stats.num_ranks)]
        last = max(range(len(ready)), key=ready.__getitem__)
        second = max(t for r, t in enumerate(ready) if r != last)
        waited = tuple(max(0, ready[last] - t) / 1e3 for t in ready)
        out.append(LateCall(seq, got[last].kind, last, (ready[last] - second) / 1e3, waited))
    return out


def stragglers(stats: Stats, evidence: int = 5) -> StragglerReport:
    """The straggler report of a merged snapshot (see the module doc)."""
    calls = late_calls(stats) if stats.num_ranks > 1 else []
    total_R = [0.0] * stats.num_ranks
    for late in calls:
        total_R[late.rank] += late.late_us
    if not calls:
        return StragglerReport(None, 0, 0, 0.0, 0.0, None, "", tuple(total_R), ())
    rank = max(range(stats.num_ranks), key=total_R.__getitem__)
    mine = sorted((c for c in calls if c.rank == rank), key=lambda c: -c.late_us)
    by_kind: dict[str, float] = {}
    for late in mine:
        by_kind[late.kind] = by_kind.get(late.kind, 0.0) + late.late_us
    return StragglerReport(
        rank=rank,
        calls=len(calls),
        last_in=len(mine),
        total_us=total_R[rank],
        median_us=statistics.median(c.late_us for c in mine),
        worst=mine[0],
        half=max(by_kind, key=by_kind.__getitem__),
        total_us_R=tuple(total_R),
        evidence=tuple(mine[:evidence]),
    )

"""What a Buffer's calls did, as one typed snapshot: `Buffer(stats=True)`, then `buf.stats()`.

A snapshot holds, for the ranks whose records it carries (one rank, or all of them after
`buf.stats(merge=True)`):

    calls and time       calls per kind, and the time spent in them, per rank
    traffic_rows_RR      int64 [R, R]: rows sent from source (row) to destination (column)
    traffic_bytes_RR     int64 [R, R]: the same in bytes (payload, FP8 scales, routing words)
    expert_load_LE       int64 [layers, E]: tokens routed to each expert, vLLM's expert-load shape
    recent               the last N calls of each rank, each a `CallRecord` with its timestamps

Every rank sees only its own sends, so a one-rank snapshot fills only its row of the traffic
matrices; the merged one (one collective) fills them all, and is the one that can say who
waited for whom (`wait_matrix_RR`): on one host all ranks stamp with the same clock.

Kinds of call: "dispatch", "combine" (normal mode), "ll_dispatch", "ll_combine" (low latency).
Legend: see `ubep.layout`.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import torch

KINDS = ("dispatch", "combine", "ll_dispatch", "ll_combine")


@dataclass(frozen=True, kw_only=True, slots=True)
class StatsOptions:
    """What `Buffer(stats=...)` records beyond the cumulative counters.

    recent: calls kept with their timestamps, per rank (the trace, the wait matrix and the
        straggler report read these).
    layers: dispatches per forward pass when one Buffer serves every MoE layer in order (as
        DeepEP's does): dispatch i counts towards layer i % layers of `expert_load_LE`.
    """

    recent: int = 1024
    layers: int = 1

    def __post_init__(self) -> None:
        if self.recent < 0 or self.layers < 1:
            raise ValueError(f"StatsOptions: recent must be >= 0 and layers >= 1, got {self}")


class CallRecord(NamedTuple):
    """One call on one rank (a NamedTuple: one is made per call). Times are wall-clock
    nanoseconds (`time.time_ns`).

    ready_ns: the rank's inputs were checked and it began to send (its data may land from here);
    sent_ns: its send half returned (low-latency calls; = ready_ns where the halves are one call);
    end_ns: it had its results.
    """

    seq: int  # the call's number, the same on every rank
    kind: str
    rank: int
    ready_ns: int
    sent_ns: int
    end_ns: int
    rows_R: tuple[int, ...]  # rows this rank sent to each rank
    row_bytes: int  # bytes of each of those rows
    tokens: int  # tokens this rank passed in (dispatch), rows (combine)
    recv_rows: int  # rows this rank received (-1 where not known when the call returned)

    @property
    def bytes_R(self) -> tuple[int, ...]:
        return tuple(rows * self.row_bytes for rows in self.rows_R)


@dataclass(frozen=True, kw_only=True)
class Stats:
    """A snapshot of one rank's records, or of every rank's (`merged`). See the module doc."""

    ranks: tuple[int, ...]
    num_ranks: int
    num_experts: int
    calls: dict[str, int]  # per kind: calls each rank made (the same on every rank)
    time_ns: dict[str, tuple[int, ...]]  # per kind: total time in calls, one entry per rank of `ranks`
    traffic_rows_RR: torch.Tensor
    traffic_bytes_RR: torch.Tensor
    expert_load_LE: torch.Tensor
    recent: tuple[CallRecord, ...] = field(default=())

    @property
    def merged(self) -> bool:
        return len(self.ranks) == self.num_ranks

    @property
    def expert_load_E(self) -> torch.Tensor:
        """int64 [E]: tokens per expert, over every layer slot."""
        return self.expert_load_LE.sum(dim=0)

    def calls_by_seq(self) -> dict[int, dict[int, CallRecord]]:
        """The recent calls, seq -> rank -> record (only seqs that every rank of `ranks` still holds)."""
        by_seq: dict[int, dict[int, CallRecord]] = {}
        for rec in self.recent:
            by_seq.setdefault(rec.seq, {})[rec.rank] = rec
        return {s: got for s, got in sorted(by_seq.items()) if len(got) == len(self.ranks)}

    def wait_matrix_RR(self, kind: str | None = None) -> torch.Tensor:
        """float64 [R, R]: mean microseconds receiver r (row) waited for source s (column) per call.

        Source s's data can land on r no sooner than s began to send; r waited for it
        max(0, ready[s] - ready[r]) past its own start. Needs a merged snapshot on one host
        (the ranks' clocks must agree); the mean runs over the recent calls of `kind` (all: None).
        """
        if not self.merged:
            raise ValueError("the wait matrix needs every rank's records: take buf.stats(merge=True)")
        R = self.num_ranks
        total_RR, n = torch.zeros(R, R, dtype=torch.float64, device="cpu"), 0
        for got in self.calls_by_seq().values():
            if kind is not None and got[0].kind != kind:
                continue
            ready_R = torch.tensor([got[r].ready_ns for r in range(R)], dtype=torch.float64, device="cpu")
            total_RR += (ready_R.unsqueeze(0) - ready_R.unsqueeze(1)).clamp(min=0)
            n += 1
        return total_RR / max(n, 1) / 1e3

    def waited_us_R(self, kind: str | None = None) -> torch.Tensor:
        """float64 [R]: mean microseconds each rank waited per call for the last peer to begin
        sending (the row maxima of each call's waits; merged snapshots only)."""
        if not self.merged:
            raise ValueError("waits need every rank's records: take buf.stats(merge=True)")
        total_R, n = torch.zeros(self.num_ranks, dtype=torch.float64, device="cpu"), 0
        for got in self.calls_by_seq().values():
            if kind is None or got[0].kind == kind:
                ready_R = torch.tensor(
                    [got[r].ready_ns for r in range(self.num_ranks)], dtype=torch.float64, device="cpu"
                )
                total_R += ready_R.max() - ready_R
                n += 1
        return total_R / max(n, 1) / 1e3

    def summary(self) -> str:
        """A few lines for a terminal: calls, time per call, traffic, the hottest experts."""
        lines = [f"ubep stats of rank(s) {_ranks(self.ranks)} of {self.num_ranks}"]
        for kind, count in self.calls.items():
            per_call = statistics.mean(self.time_ns[kind]) / max(count, 1) / 1e3
            lines.append(f"  {kind}: {count} calls, {per_call:.1f} us each (mean over ranks)")
        if self.merged and self.num_ranks > 1 and self.recent:
            waited = self.waited_us_R()
            lines.append(
                f"  waiting for the last peer: {float(waited.mean()):.1f} us per call (mean over ranks), "
                f"most on rank {int(waited.argmax())} ({float(waited.max()):.1f} us)"
            )
        rows, nbytes = int(self.traffic_rows_RR.sum()), int(self.traffic_bytes_RR.sum())
        lines.append(f"  traffic: {rows} rows, {nbytes / 1e6:.2f} MB")
        load = self.expert_load_E
        if int(load.sum()):
            top = torch.topk(load, min(3, load.numel()))
            share = ", ".join(
                f"expert {int(e)}: {int(c)} ({int(c) / int(load.sum()):.1%})"
                for c, e in zip(top.values, top.indices, strict=True)
            )
            lines.append(f"  hottest experts: {share}")
        return "\n".join(lines)

    # -- merging and files ------------------------------------------------------------------------

    @staticmethod
    def combine_ranks(parts: list[Stats]) -> Stats:
        """One snapshot from every rank's own (in rank order): matrices and loads summed."""
        first = parts[0]
        kinds = [k for k in KINDS if any(k in p.calls for p in parts)]  # a receive half may still be pending
        return replace(
            first,
            ranks=tuple(r for p in parts for r in p.ranks),
            calls={k: max(p.calls.get(k, 0) for p in parts) for k in kinds},
            time_ns={
                k: tuple(t for p in parts for t in p.time_ns.get(k, (0,) * len(p.ranks))) for k in kinds
            },
            traffic_rows_RR=sum((p.traffic_rows_RR for p in parts), torch.zeros_like(first.traffic_rows_RR)),
            traffic_bytes_RR=sum(
                (p.traffic_bytes_RR for p in parts), torch.zeros_like(first.traffic_bytes_RR)
            ),
            expert_load_LE=sum((p.expert_load_LE for p in parts), torch.zeros_like(first.expert_load_LE)),
            recent=tuple(rec for p in parts for rec in p.recent),
        )

    def to_dict(self) -> dict:
        return {
            "ranks": list(self.ranks),
            "num_ranks": self.num_ranks,
            "num_experts": self.num_experts,
            "calls": self.calls,
            "time_ns": {k: list(v) for k, v in self.time_ns.items()},
            "traffic_rows_RR": self.traffic_rows_RR.tolist(),
            "traffic_bytes_RR": self.traffic_bytes_RR.tolist(),
            "expert_load_LE": self.expert_load_LE.tolist(),
            "recent": [rec._asdict() for rec in self.recent],
        }

    @classmethod
    def from_dict(cls, d: dict) -> Stats:
        """The snapshot `to_dict` wrote; ValueError naming the first field that breaks its schema."""
        check_schema(d)
        return cls(
            ranks=tuple(d["ranks"]),
            num_ranks=d["num_ranks"],
            num_experts=d["num_experts"],
            calls=dict(d["calls"]),
            time_ns={k: tuple(v) for k, v in d["time_ns"].items()},
            traffic_rows_RR=torch.tensor(d["traffic_rows_RR"], dtype=torch.int64, device="cpu"),
            traffic_bytes_RR=torch.tensor(d["traffic_bytes_RR"], dtype=torch.int64, device="cpu"),
            expert_load_LE=torch.tensor(d["expert_load_LE"], dtype=torch.int64, device="cpu"),
            recent=tuple(CallRecord(**{**r, "rows_R": tuple(r["rows_R"])}) for r in d["recent"]),
        )

    def save(self, path: str | Path) -> None:
        """Write the snapshot as JSON (`ubep report PATH` reads it back)."""
        Path(path).write_text(json.dumps(self.to_dict()))

    @classmethod
    def load(cls, path: str | Path) -> Stats:
        """The snapshot saved at `path`; ValueError saying what is wrong with a file of another shape."""
        try:
            d = json.loads(Path(path).read_text())
        except RecursionError:  # a snapshot nests four levels; a hostile file, thousands
            raise ValueError(
                "its JSON nests deeper than Python's parser follows (a snapshot nests 4 levels)"
            ) from None
        return cls.from_dict(d)


# -- the file's schema ------------------------------------------------------------------------------

INT64_MAX = 2**63 - 1  # the counters' type: every count, and every matrix's total, must fit it
FIELDS = (
    "ranks",
    "num_ranks",
    "num_experts",
    "calls",
    "time_ns",
    "traffic_rows_RR",
    "traffic_bytes_RR",
    "expert_load_LE",
    "recent",
)


def check_schema(d: object) -> None:
    """Raise ValueError naming the first field of a `to_dict` snapshot that breaks its schema
    (`ubep report` reads files written by other programs and versions, or by hand)."""
    _fields("the file", d, FIELDS)
    R = _count("num_ranks", d["num_ranks"], 1)
    E = _count("num_experts", d["num_experts"], 1)
    ranks = [_count(f"ranks[{i}]", r, 0, R) for i, r in enumerate(_list("ranks", d["ranks"]))]
    if not ranks or len(set(ranks)) != len(ranks):
        raise _wrong("ranks", "distinct rank ids, at least one", d["ranks"])
    calls = _dict("calls", d["calls"])
    for kind, count in calls.items():
        if kind not in KINDS:
            raise ValueError(f"calls: unexpected kind {kind!r} (kinds: {', '.join(KINDS)})")
        _count(f"calls.{kind}", count, 0)
    times = _dict("time_ns", d["time_ns"])
    if set(times) != set(calls):
        raise _wrong("time_ns", f"the kinds of calls ({', '.join(calls)})", times)
    for kind, per_rank in times.items():
        _counts(f"time_ns.{kind}", per_rank, len(ranks))
    for name in ("traffic_rows_RR", "traffic_bytes_RR"):
        for i, row in enumerate(_list(name, d[name], R)):
            _counts(f"{name}[{i}]", row, R)
        _fits_int64(name, d[name])
    layers = _list("expert_load_LE", d["expert_load_LE"])
    if not layers:
        raise _wrong("expert_load_LE", "at least one layer", layers)
    for i, row in enumerate(layers):
        _counts(f"expert_load_LE[{i}]", row, E)
    _fits_int64("expert_load_LE", layers)
    for i, rec in enumerate(_list("recent", d["recent"])):
        _check_record(f"recent[{i}]", rec, ranks, R)


def _check_record(where: str, rec, ranks: list[int], num_ranks: int) -> None:
    _fields(where, rec, CallRecord._fields)
    _count(f"{where}.seq", rec["seq"], 0)
    if rec["kind"] not in KINDS:
        raise _wrong(f"{where}.kind", f"one of {', '.join(KINDS)}", rec["kind"])
    if isinstance(rec["rank"], bool) or rec["rank"] not in ranks:
        raise _wrong(f"{where}.rank", f"one of the ranks {tuple(ranks)}", rec["rank"])
    for name in ("ready_ns", "sent_ns", "end_ns", "row_bytes", "tokens"):
        _count(f"{where}.{name}", rec[name], 0)
    _count(f"{where}.recv_rows", rec["recv_rows"], -1)
    _counts(f"{where}.rows_R", rec["rows_R"], num_ranks)


def _wrong(where: str, rule: str, value) -> ValueError:
    try:
        shown = json.dumps(value)
    except RecursionError:
        shown = "a value nested too deep to show"
    return ValueError(f"{where}: expected {rule}, got {shown if len(shown) <= 40 else shown[:37] + '...'}")


def _fits_int64(where: str, rows) -> None:
    """The matrix's entries (each already a count) add up within int64: the report sums them in
    int64 tensors, where a larger total wraps to a negative number."""
    total = sum(sum(row) for row in rows)
    if total > INT64_MAX:
        raise ValueError(f"{where}: its entries add up to {total}, more than int64 holds (2**63 - 1)")


def _fields(where: str, d, names: tuple[str, ...]) -> None:
    if not isinstance(d, dict):
        raise _wrong(where, "an object", d)
    missing, extra = [n for n in names if n not in d], [n for n in d if n not in names]
    if missing:
        raise ValueError(f"{where}: missing field {missing[0]!r}")
    if extra:
        raise ValueError(f"{where}: unexpected field {extra[0]!r}")


def _dict(where: str, value) -> dict:
    if not isinstance(value, dict):
        raise _wrong(where, "an object", value)
    return value


def _list(where: str, value, length: int | None = None) -> list | tuple:
    if not isinstance(value, list | tuple):  # JSON's lists; tuples where `to_dict` did not go through JSON
        raise _wrong(where, "a list" if length is None else f"a list of {length} entries", value)
    if length is not None and len(value) != length:
        raise _wrong(where, f"a list of {length} entries", value)
    return value


def _count(where: str, value, lo: int, hi: int | None = None) -> int:
    number = isinstance(value, int) and not isinstance(value, bool)
    if not (number and lo <= value and (hi is None or value < hi)):
        raise _wrong(where, f"an int >= {lo}" if hi is None else f"a rank id in [{lo}, {hi})", value)
    if value > INT64_MAX:
        raise _wrong(where, "an int64 (at most 2**63 - 1)", value)
    return value


def _counts(where: str, value, length: int) -> None:
    for i, v in enumerate(_list(where, value, length)):
        _count(f"{where}[{i}]", v, 0)


def _ranks(ranks: tuple[int, ...]) -> str:
    if len(ranks) > 1 and ranks == tuple(range(len(ranks))):
        return f"0-{len(ranks) - 1}"
    return ", ".join(map(str, ranks))

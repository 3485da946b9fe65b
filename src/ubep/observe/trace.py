"""A Perfetto / Chrome trace of stats snapshots: one process per rank, one slice per call.

Trace-event JSON ("X" complete events: name, ph, ts and dur in microseconds, pid, tid),
which ui.perfetto.dev and chrome://tracing open. Per rank and Buffer (a model's MoE
layers have one Buffer each; pass their snapshots by name):
    thread "<name> calls":   each call from the moment the rank began sending to its
                             results, with its low-latency halves ("send", "receive") inside;
    thread "<name> waiting": in a merged snapshot, from the rank's start until the last
                             peer began sending, named for that peer: who waited for whom.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from ubep.stats import Stats


def _slice(name: str, start_ns: int, end_ns: int, zero_ns: int, rank: int, tid: int, args: dict) -> dict:
    return {
        "name": name,
        "cat": "ubep",
        "ph": "X",
        "ts": (start_ns - zero_ns) / 1e3,
        "dur": max(end_ns - start_ns, 0) / 1e3,
        "pid": rank,
        "tid": tid,
        "args": args,
    }


def _meta(kind: str, rank: int, tid: int, name: str) -> dict:
    return {"name": kind, "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}}


def _calls(stats: Stats, zero: int, tid: int) -> list[dict]:
    events = []
    for rec in stats.recent:
        args = {"seq": rec.seq, "tokens": rec.tokens, "rows_sent": sum(rec.rows_R),
                "bytes_sent": sum(rec.bytes_R), "rows_received": rec.recv_rows}  # fmt: skip
        events.append(_slice(rec.kind, rec.ready_ns, rec.end_ns, zero, rec.rank, tid, args))
        if rec.sent_ns != rec.ready_ns:  # a low-latency call: its halves apart
            events.append(_slice("send", rec.ready_ns, rec.sent_ns, zero, rec.rank, tid, {"seq": rec.seq}))
            events.append(_slice("receive", rec.sent_ns, rec.end_ns, zero, rec.rank, tid, {"seq": rec.seq}))
    return events


def _waits(stats: Stats, zero: int, tid: int) -> list[dict]:
    events = []
    if not stats.merged or stats.num_ranks < 2:
        return events
    for seq, got in stats.calls_by_seq().items():
        last = max(got.values(), key=lambda rec: rec.ready_ns)
        for rec in got.values():
            if rec.rank != last.rank and last.ready_ns > rec.ready_ns:
                name = f"waiting for rank {last.rank}"
                events.append(_slice(name, rec.ready_ns, last.ready_ns, zero, rec.rank, tid, {"seq": seq}))
    return events


def chrome_trace(stats: Stats | Mapping[str, Stats]) -> dict:
    """The trace of one snapshot, or of several by name, as a JSON-ready dict
    ({"traceEvents": [...], "displayTimeUnit": "ns"}); times count from the earliest call."""
    named = {"": stats} if isinstance(stats, Stats) else dict(stats)
    ranks = sorted({r for s in named.values() for r in s.ranks})
    events = [_meta("process_name", r, 0, f"rank {r}") for r in ranks]
    starts = [rec.ready_ns for s in named.values() for rec in s.recent]
    zero = min(starts, default=0)
    for i, (name, s) in enumerate(named.items()):
        calls, waiting = 2 * i, 2 * i + 1
        prefix = f"{name} " if name else ""
        for r in s.ranks:
            events.append(_meta("thread_name", r, calls, f"{prefix}calls"))
            events.append(_meta("thread_name", r, waiting, f"{prefix}waiting"))
        events += _calls(s, zero, calls) + _waits(s, zero, waiting)
    return {"traceEvents": events, "displayTimeUnit": "ns"}


def write_trace(stats: Stats | Mapping[str, Stats], path: str | Path) -> None:
    """Write `chrome_trace(stats)` to `path` (open it in ui.perfetto.dev)."""
    Path(path).write_text(json.dumps(chrome_trace(stats)))

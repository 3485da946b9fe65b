"""A Perfetto / Chrome trace of a stats snapshot: one process per rank, one slice per call.

Trace-event JSON ("X" complete events: name, ph, ts and dur in microseconds, pid, tid),
which ui.perfetto.dev and chrome://tracing open. Per rank:
    thread "calls":   each call from the moment the rank began sending to its results, with
                      its low-latency halves ("send", "receive") nested inside;
    thread "waiting": in a merged snapshot, from the rank's start until the last peer began
                      sending, named for that peer: who waited for whom.
"""

from __future__ import annotations

import json
from pathlib import Path

from ubep.stats import Stats

CALLS, WAITING = 0, 1  # thread ids


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


def _names(ranks: tuple[int, ...]) -> list[dict]:
    events = []
    for rank in ranks:
        events.append(
            {"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}}
        )
        for tid, name in ((CALLS, "calls"), (WAITING, "waiting")):
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}})
    return events


def chrome_trace(stats: Stats) -> dict:
    """The trace as a JSON-ready dict ({"traceEvents": [...], "displayTimeUnit": "ns"})."""
    events = _names(stats.ranks)
    if not stats.recent:
        return {"traceEvents": events, "displayTimeUnit": "ns"}
    zero = min(rec.ready_ns for rec in stats.recent)
    for rec in stats.recent:
        args = {"seq": rec.seq, "tokens": rec.tokens, "rows_sent": sum(rec.rows_R),
                "bytes_sent": sum(rec.bytes_R), "rows_received": rec.recv_rows}  # fmt: skip
        events.append(_slice(rec.kind, rec.ready_ns, rec.end_ns, zero, rec.rank, CALLS, args))
        if rec.sent_ns != rec.ready_ns:  # a low-latency call: its halves apart
            events.append(_slice("send", rec.ready_ns, rec.sent_ns, zero, rec.rank, CALLS, {"seq": rec.seq}))
            events.append(_slice("receive", rec.sent_ns, rec.end_ns, zero, rec.rank, CALLS, {"seq": rec.seq}))
    if stats.merged and stats.num_ranks > 1:
        for seq, got in stats.calls_by_seq().items():
            last = max(got.values(), key=lambda rec: rec.ready_ns)
            for rec in got.values():
                if rec.rank != last.rank and last.ready_ns > rec.ready_ns:
                    name = f"waiting for rank {last.rank}"
                    events.append(
                        _slice(name, rec.ready_ns, last.ready_ns, zero, rec.rank, WAITING, {"seq": seq})
                    )
    return {"traceEvents": events, "displayTimeUnit": "ns"}


def write_trace(stats: Stats, path: str | Path) -> None:
    """Write `chrome_trace(stats)` to `path` (open it in ui.perfetto.dev)."""
    Path(path).write_text(json.dumps(chrome_trace(stats)))

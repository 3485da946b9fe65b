"""Prometheus metrics of a stats snapshot, through `prometheus_client` (the `observe` extra).

Names follow Prometheus' conventions: a `ubep_` prefix, base units (seconds, bytes) in the
name, `_total` on counters. Every series is labelled with the rank that counted it:

    ubep_calls_total{rank, kind}                    counter: calls made
    ubep_call_seconds_total{rank, kind}             counter: time in them
    ubep_sent_rows_total{source, destination}       counter: the traffic matrix, in rows
    ubep_sent_bytes_total{source, destination}      counter: and in bytes
    ubep_expert_tokens_total{layer, expert}         counter: the expert load
    ubep_peer_wait_seconds{receiver, source}        gauge: mean wait per recent call (merged only)

A live job registers a `StatsCollector` over a function returning the snapshot, so every scrape
reads the current counters:

    from prometheus_client import REGISTRY, start_http_server
    REGISTRY.register(StatsCollector(buf.stats))
    start_http_server(9400)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ubep.stats import Stats


class StatsCollector:
    """A prometheus_client collector over `source` (a snapshot, or a function returning one)."""

    def __init__(self, source: Stats | Callable[[], Stats]):
        self._source = source

    def collect(self) -> Iterator[Metric]:
        stats = self._source() if callable(self._source) else self._source
        calls = CounterMetricFamily("ubep_calls", "Calls made, per rank and kind", labels=["rank", "kind"])
        seconds = CounterMetricFamily(
            "ubep_call_seconds", "Time spent in calls, per rank and kind", labels=["rank", "kind"]
        )
        for kind, count in stats.calls.items():
            for rank, ns in zip(stats.ranks, stats.time_ns[kind], strict=True):
                calls.add_metric([str(rank), kind], count)
                seconds.add_metric([str(rank), kind], ns / 1e9)
        yield calls
        yield seconds
        yield from _matrix("ubep_sent_rows", "Rows sent, per source and destination rank", stats, "rows")
        yield from _matrix("ubep_sent_bytes", "Bytes sent, per source and destination rank", stats, "bytes")
        load = CounterMetricFamily(
            "ubep_expert_tokens", "Tokens routed to each expert, per layer slot", labels=["layer", "expert"]
        )
        for layer, row in enumerate(stats.expert_load_LE.tolist()):
            for expert, tokens in enumerate(row):
                load.add_metric([str(layer), str(expert)], tokens)
        yield load
        if stats.merged and stats.recent:
            wait = GaugeMetricFamily(
                "ubep_peer_wait_seconds",
                "Mean time a receiver waited for a source per recent call",
                labels=["receiver", "source"],
            )
            for r, row in enumerate(stats.wait_matrix_RR().tolist()):
                for s, us in enumerate(row):
                    wait.add_metric([str(r), str(s)], us / 1e6)
            yield wait


def _matrix(name: str, doc: str, stats: Stats, unit: str) -> Iterator[Metric]:
    family = CounterMetricFamily(name, doc, labels=["source", "destination"])
    matrix = stats.traffic_rows_RR if unit == "rows" else stats.traffic_bytes_RR
    for src in stats.ranks:
        for dst, value in enumerate(matrix[src].tolist()):
            family.add_metric([str(src), str(dst)], value)
    yield family


def prometheus_text(stats: Stats) -> str:
    """The snapshot in Prometheus' text exposition format."""
    registry = CollectorRegistry()
    registry.register(StatsCollector(stats))
    return generate_latest(registry).decode()

"""Exporters of a `ubep.stats.Stats` snapshot (`buf.stats(merge=True)`, or `Stats.load(path)`):

    chrome_trace / write_trace   Perfetto / Chrome trace-event JSON of each rank's calls and waits
    prometheus_text, StatsCollector   Prometheus metrics (needs the `observe` extra: prometheus_client)
    write_heatmap                the traffic matrix and the expert load as a PNG (needs matplotlib)
    stragglers                   which rank held the others up most, by how much, in which half

Each reads only the snapshot, so it runs as well on a file written by a job long gone
(`ubep report stats.json`). Optional dependencies are imported when used.
"""

from ubep.observe.straggler import StragglerReport, stragglers
from ubep.observe.trace import chrome_trace, write_trace


def prometheus_text(stats) -> str:
    """The snapshot in Prometheus' text format (`ubep.observe.prometheus`)."""
    from ubep.observe.prometheus import prometheus_text as text

    return text(stats)


def write_heatmap(stats, path) -> None:
    """The traffic matrix and expert load as a PNG at `path` (`ubep.observe.heatmap`)."""
    from ubep.observe.heatmap import write_heatmap as write

    write(stats, path)


__all__ = ["StragglerReport", "chrome_trace", "prometheus_text", "stragglers", "write_heatmap", "write_trace"]

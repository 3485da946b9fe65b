"""A picture of a stats snapshot: the traffic matrix (MB, source x destination), the wait
matrix of a merged snapshot (mean us a receiver waited for each source per call), and the
expert load (tokens, layer slot x expert). Needs matplotlib (the `observe` or `bench` extra).

Every colour scale starts at 0, so that 16 MB beside 20 MB reads as the small difference it
is; rank and layer axes carry whole-number ticks only; the layout is constrained, so no axis
label is cut at the figure's edge.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure  # a bare figure draws to files, with no display or global backend
from matplotlib.ticker import MaxNLocator

from ubep.stats import Stats


def heatmap_figure(stats: Stats) -> Figure:
    """The panels as a matplotlib Figure (what `write_heatmap` saves)."""
    waits = stats.merged and stats.num_ranks > 1 and bool(stats.recent)
    fig = Figure(figsize=(15 if waits else 11, 4.2), layout="constrained")
    axes = fig.subplots(1, 3 if waits else 2, width_ratios=(1, 1, 2.2) if waits else (1, 2.2))
    panels = [("traffic (MB sent)", stats.traffic_bytes_RR.double().numpy() / 1e6, "viridis")]
    if waits:
        panels.append(("mean wait per call (us)", stats.wait_matrix_RR().numpy(), "inferno"))
    for ax, (title, values, cmap) in zip(axes, panels, strict=False):
        fig.colorbar(ax.imshow(values, cmap=cmap, vmin=0), ax=ax, shrink=0.8)
        ax.set(title=title, xlabel="source rank" if "wait" in title else "destination rank")
        ax.set_ylabel("receiver rank" if "wait" in title else "source rank")
        _whole_ticks(ax)
    load, ax = stats.expert_load_LE.numpy(), axes[-1]
    image = ax.imshow(load, cmap="magma", aspect="auto", interpolation="nearest", vmin=0)
    fig.colorbar(image, ax=ax, shrink=0.8)
    ax.set(title="expert load (tokens)", xlabel="expert", ylabel="layer slot")
    _whole_ticks(ax)
    fig.suptitle(f"ubep stats: {sum(stats.calls.values())} calls per rank, {stats.num_ranks} ranks")
    return fig


def _whole_ticks(ax) -> None:
    """Ticks on whole numbers only (ranks, experts, layer slots), even where one row is all there is."""
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))


def write_heatmap(stats: Stats, path: str | Path) -> None:
    """Write the heatmaps to `path` (PNG)."""
    heatmap_figure(stats).savefig(path, dpi=110)

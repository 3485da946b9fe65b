"""A picture of a stats snapshot: the traffic matrix (bytes, source x destination) beside the
expert load (tokens, layer slot x expert). Needs matplotlib (the `bench` extra)."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure  # a bare figure draws to files, with no display or global backend

from ubep.stats import Stats


def write_heatmap(stats: Stats, path: str | Path) -> None:
    """Write the two heatmaps to `path` (PNG)."""
    fig = Figure(figsize=(11, 4.2))
    left, right = fig.subplots(1, 2, width_ratios=(1, 2.2))
    traffic = stats.traffic_bytes_RR.double() / 1e6
    shown = left.imshow(traffic.numpy(), cmap="viridis")
    left.set(title="traffic (MB sent)", xlabel="destination rank", ylabel="source rank")
    fig.colorbar(shown, ax=left, shrink=0.8)
    load = stats.expert_load_LE.numpy()
    shown = right.imshow(load, cmap="magma", aspect="auto", interpolation="nearest")
    right.set(title="expert load (tokens)", xlabel="expert", ylabel="layer slot")
    right.set_yticks(range(load.shape[0]))
    fig.colorbar(shown, ax=right, shrink=0.8)
    fig.suptitle(f"ubep stats: {sum(stats.calls.values())} calls per rank, {stats.num_ranks} ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)

"""A picture of a stats snapshot: the traffic matrix (MB, source x destination), the wait
matrix of a merged snapshot (mean us a receiver waited for each source per call), and the
expert load (tokens, layer slot x expert). Needs matplotlib (the `bench` extra)."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure  # a bare figure draws to files, with no display or global backend

from ubep.stats import Stats


def write_heatmap(stats: Stats, path: str | Path) -> None:
    """Write the heatmaps to `path` (PNG)."""
    waits = stats.merged and stats.num_ranks > 1 and bool(stats.recent)
    fig = Figure(figsize=(15 if waits else 11, 4.2))
    axes = fig.subplots(1, 3 if waits else 2, width_ratios=(1, 1, 2.2) if waits else (1, 2.2))
    panels = [("traffic (MB sent)", stats.traffic_bytes_RR.double().numpy() / 1e6, "viridis")]
    if waits:
        panels.append(("mean wait per call (us)", stats.wait_matrix_RR().numpy(), "inferno"))
    for ax, (title, values, cmap) in zip(axes, panels, strict=False):
        fig.colorbar(ax.imshow(values, cmap=cmap), ax=ax, shrink=0.8)
        ax.set(title=title, xlabel="source rank" if "wait" in title else "destination rank")
        ax.set_ylabel("receiver rank" if "wait" in title else "source rank")
    load, ax = stats.expert_load_LE.numpy(), axes[-1]
    fig.colorbar(ax.imshow(load, cmap="magma", aspect="auto", interpolation="nearest"), ax=ax, shrink=0.8)
    ax.set(title="expert load (tokens)", xlabel="expert", ylabel="layer slot")
    ax.set_yticks(range(load.shape[0]))
    fig.suptitle(f"ubep stats: {sum(stats.calls.values())} calls per rank, {stats.num_ranks} ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)

"""The paper's two ablations and its headline, beside the simulator's numbers.

  scheduling  64 devices (cm-ablation: four 16-device nodes under a tier-2 switch),
              256 experts, top-8, 8 hot experts, ubep protocol; only the scheduler's
              policy changes (bsp -> balanced -> distance); metric: the slowest sender worker.
  sync        CloudMatrix384 EP64, one expert per device, ubep protocol; each
              data-as-flag variant against stop-and-wait flags; metric: dispatch latency.
  headline    ubep against the bsp protocol on CloudMatrix384, EP64 and EP128, one
              expert per device, batches 8-128; metric: dispatch latency reduction.

The published values are the UBEP paper's (production CloudMatrix384), in docs/paper_figures.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ubep import topology
from ubep.costmodel import CostParams
from ubep.registry import BSP, UBEP
from ubep.schedule import BALANCED, BASELINE, DISTANCE
from ubep.sim.run import SimConfig, simulate, workload
from ubep.sim.sync import DATA_AS_FLAG, SYNCS

PAPER_SCHEDULING_US = {BASELINE: 62.2, BALANCED: 48.1, DISTANCE: 43.5}  # by scheduler policy
PAPER_SYNC_RANGE = (31.0, 57.1)  # % reduction of TFF/DC/SP against stop-and-wait flags
PAPER_HEADLINE = {  # (EP, batch) -> % dispatch latency reduction of ubep against BSP
    (64, 8): 52.4,
    (64, 128): 34.7,
    (128, 128): 35.9,
}
PAPER_EP128_MEAN_8_64 = 46.4
BATCHES = (8, 16, 32, 64, 128)
ABLATION_HOT_EXPERTS = 8
FIT_HOT_SHARE = 0.03  # the hot experts' share of picks, fitted on the first step (calibrate.py)


@dataclass(frozen=True, kw_only=True, slots=True)
class Bar:
    """One simulated number beside the published one (None where the paper gives none), in `unit`:
    "us" (a latency) or "%" (a change against a baseline)."""

    group: str
    label: str
    simulated: float
    unit: str
    published: float | None = None

    def shown(self, value: float | None) -> str:
        """`value` (the simulated or the published one) with its unit: "-41.3%", "43.5 us"."""
        if value is None:
            return ""
        return f"{value:.1f}%" if self.unit == "%" else f"{value:.1f} {self.unit}"


def scheduling_config(params: CostParams, hot_share: float) -> SimConfig:
    return SimConfig(
        topology=topology.cm_ablation(),
        ranks=64,
        hot_experts=ABLATION_HOT_EXPERTS,
        hot_share=hot_share,
        params=params,
    )


def scheduling(params: CostParams, hot_share: float) -> list[Bar]:
    """Slowest dispatch worker (us) per scheduler policy, and each step's change (%)."""
    cfg = scheduling_config(params, hot_share)
    wl = workload(cfg)
    us = {p: simulate(replace(cfg, policy=p), UBEP.name, wl).dispatch_worker_us for p in PAPER_SCHEDULING_US}
    bars = [Bar(group="slowest worker (us)", label=p, simulated=us[p], unit="us", published=v)
            for p, v in PAPER_SCHEDULING_US.items()]  # fmt: skip
    for a, b in ((BASELINE, BALANCED), (BALANCED, DISTANCE)):
        bars.append(Bar(group="step (%)", label=f"{a} -> {b}", simulated=_change(us[a], us[b]), unit="%",
                        published=_change(PAPER_SCHEDULING_US[a], PAPER_SCHEDULING_US[b])))  # fmt: skip
    return bars


def _change(before: float, after: float) -> float:
    return (after - before) / before * 100


def sync(params: CostParams, batches=BATCHES, ranks: int = 64) -> list[Bar]:
    """Dispatch latency change (%) of each data-as-flag variant against stop-and-wait, per batch."""
    bars = []
    for n in batches:
        cfg = SimConfig(ranks=ranks, experts=ranks, tokens=n, params=params)
        wl = workload(cfg)
        us = {s: simulate(replace(cfg, sync=s), UBEP.name, wl).dispatch_us for s in SYNCS}
        bars += [Bar(group=f"batch {n}", label=s, simulated=_change(us["stop-and-wait"], us[s]), unit="%")
                 for s in DATA_AS_FLAG]  # fmt: skip
    return bars


def headline(params: CostParams, batches=BATCHES, eps=(64, 128)) -> list[Bar]:
    """Dispatch latency change (%) of ubep against bsp, one expert per device, on CloudMatrix384."""
    bars = []
    for ep in eps:
        for n in batches:
            cfg = SimConfig(ranks=ep, experts=ep, tokens=n, params=params)
            wl = workload(cfg)
            u, b = (simulate(cfg, p, wl).dispatch_us for p in (UBEP.name, BSP.name))
            pub = PAPER_HEADLINE.get((ep, n))
            bars.append(Bar(group=f"EP{ep}", label=f"batch {n}", simulated=_change(b, u), unit="%",
                            published=None if pub is None else -pub))  # fmt: skip
    return bars


def plot(bars: list[Bar], path: str, title: str, band: tuple[float, float] | None = None) -> None:
    """Grouped bars, simulated beside published; `band` shades a published range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    groups = list(dict.fromkeys(b.group for b in bars))
    fig, axes = plt.subplots(1, len(groups), figsize=(4 + 2.2 * len(groups), 3.8), squeeze=False)
    for ax, g in zip(axes[0], groups, strict=True):
        gb = [b for b in bars if b.group == g]
        x = np.arange(len(gb))
        ax.bar(x - 0.2, [b.simulated for b in gb], 0.4, label="simulated")
        pub = [np.nan if b.published is None else b.published for b in gb]
        if not all(np.isnan(pub)):
            ax.bar(x + 0.2, pub, 0.4, label="paper")
        if band is not None:
            ax.axhspan(-band[1], -band[0], color="grey", alpha=0.2, label="paper's range")
        ax.set_xticks(x, [b.label for b in gb], rotation=20, fontsize=8)
        ax.set_title(g, fontsize=9)
        ax.axhline(0, color="black", linewidth=0.5)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

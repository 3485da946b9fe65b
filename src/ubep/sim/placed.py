"""`ubep simulate --placement`: the same workload with experts placed, on the superpod model.

Each placement turns the workload's logical routing into physical ids (E + redundant experts,
contiguous over the ranks) with its map: `none` keeps one copy per expert, `eplb` is the load-only
balancer (DeepSeek's hierarchical EPLB; every copy alike, wherever the token is), `eplb-global`
its global policy (one group, one node), `ubep` is
`placement.balance` with the nearest-copy map. The protocols then run the physical routing as any
other. Both placements see the pairs per source rank and expert of the batch they are then timed
on (what a placement does for the loads it was made for).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ubep.placement import Distances, Placement, PlacementStats, balance, eplb, measure
from ubep.placement.measure import physical_routing
from ubep.sim.protocols import Workload
from ubep.sim.run import SimConfig, SimResult, simulate
from ubep.sim.table import render

PLACEMENTS = ("none", "eplb", "eplb-global", "ubep")
EPLB_GROUPS = 8  # DeepSeek-V3's expert groups, the unit EPLB packs onto nodes
REDUNDANT_SHARE = 8  # default redundant slots: E / 8 (DeepSeek-V3: 32 for 256), rounded up to R


def redundant_slots(experts: int, ranks: int, wanted: int | None = None) -> int:
    wanted = -(-experts // REDUNDANT_SHARE) if wanted is None else wanted
    return -(-wanted // ranks) * ranks


def placed_workload(
    cfg: SimConfig, wl: Workload, name: str, redundant: int | None = None
) -> tuple[Workload, PlacementStats]:
    """The workload with placement `name` applied, and what it does to rank loads and node crossings."""
    R, E = cfg.ranks, cfg.experts
    topk = [torch.from_numpy(wl.topk_RNK[r]) for r in range(R)]
    distances = Distances.from_topology(cfg.topology, R)
    load_RE = torch.stack([torch.bincount(i[i >= 0], minlength=E) for i in topk]).double()
    L = (E + redundant_slots(E, R, redundant)) // R
    if name == "none":
        p = Placement.identity(E, R)
    elif name == "eplb":
        nodes = max(1, R // cfg.topology.levels[1].span) if cfg.topology.num_classes > 2 else 1
        p = eplb(load_RE, R, L, num_nodes=nodes, num_groups=EPLB_GROUPS)
    elif name == "eplb-global":
        p = eplb(load_RE, R, L)
    else:
        p = balance(load_RE, distances, L)
    nearest = name not in ("eplb", "eplb-global")
    physical = physical_routing(p, topk, distances if nearest else None)
    placed = replace(wl, topk_RNK=torch.stack(physical).numpy(), owner_E=p.rank_of_physical_U.numpy().copy())
    return placed, measure(p, topk, distances, cfg.hidden, nearest=nearest)


def simulate_placements(
    cfg: SimConfig, wl: Workload, names: list[str], protocol: str, redundant: int | None = None
) -> list[tuple[str, PlacementStats, SimResult]]:
    """Every placement of `names` on one configuration, timed with one protocol."""
    out = []
    for name in names:
        placed, stats = placed_workload(cfg, wl, name, redundant)
        out.append((name, stats, simulate(cfg, protocol, placed)))
    return out


def table(cfg: SimConfig, runs: list[tuple[str, PlacementStats, SimResult]], redundant: int) -> str:
    """The placements side by side, as plain text (`ubep.sim.table`)."""
    title = (
        f"placement on {cfg.topology.name}, EP{cfg.ranks}, {cfg.tokens} tokens/rank, "
        f"{cfg.routing} routing, {redundant} redundant slots ({runs[0][2].protocol} protocol, simulated)"
    )
    columns = ["placement", "max/mean load", "MB across nodes", "flat MB", "dispatch us", "combine us"]
    base = next((r for n, _, r in runs if n == "none"), None)
    rows = []
    for name, s, r in runs:
        ratio = (
            "-"
            if base is None
            else f"{(r.dispatch_us + r.combine_us) / (base.dispatch_us + base.combine_us):.2f}"
        )
        rows.append([
            name,
            f"{s.imbalance:.3f}",
            f"{s.cross_node_bytes / cfg.ranks / 1e6:.3f}",
            f"{s.cross_node_bytes_flat / cfg.ranks / 1e6:.3f}",
            f"{r.dispatch_us:.1f}",
            f"{r.combine_us:.1f}",
            ratio,
        ])  # fmt: skip
    return render(title, [*columns, "d+c x none"], rows, left=("placement",))

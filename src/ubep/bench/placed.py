"""`ubep bench --placement`: the ubep row again with experts placed, beside the plain one.

  ubep          no placement: E experts, one copy each, contiguous (the "none" placement)
  ubep+eplb     the load-only balancer (`placement.eplb`, DeepSeek's hierarchical EPLB): the caller
                maps each pair to a copy regardless of where the token is, as vLLM does, and passes
                physical ids to a Buffer of U = E + redundant experts
  ubep+eplb-global  the same with EPLB's global policy (one group, one node): better balanced where
                the groups do not balance over the nodes, blind to nodes
  ubep+placed   ubep's placement (`placement.balance`) set on the Buffer (`set_placement`): the
                Buffer maps each pair to its nearest copy before dispatching

Both placements are computed on every rank from the loads of the batch the bench then sends (the
pairs per source rank and expert): the figures say what a placement does for the loads it was made
for; in service it is made from the loads of the previous window. Every row is checked once against
the reference on its own (physical) routing before it is timed.
"""

from __future__ import annotations

from contextlib import ExitStack

import torch
import torch.distributed as dist

import ubep
from ubep import reference
from ubep.bench.turns import Calls
from ubep.bench.workload import PLACED_SYSTEMS, UBEP_ROW, BenchConfig, Workload
from ubep.placement import CopyMap, Distances, Placement, PlacementStats, balance, eplb, measure
from ubep.registry import HIER, SHM

PLACEMENTS = ("none", "eplb", "eplb-global", "ubep")
SYSTEM_OF = {"none": UBEP_ROW, **{p: f"ubep+{p}" for p in ("eplb", "eplb-global")}, "ubep": PLACED_SYSTEMS[2]}
EPLB_GROUPS = 8  # DeepSeek-V3's expert groups (256 experts in 8), the unit EPLB packs onto nodes
REDUNDANT_SHARE = 8  # default redundant slots: E / 8 (DeepSeek-V3's 32 for 256), rounded up to R


def systems(cfg: BenchConfig) -> tuple[str, ...]:
    """The placement rows to add beside the plain ubep row."""
    return tuple(SYSTEM_OF[p] for p in cfg.placements if p != "none")


def redundant(cfg: BenchConfig) -> int:
    """Redundant slots: --redundant, else E / 8 rounded up to a multiple of the ranks."""
    wanted = cfg.redundant if cfg.redundant is not None else -(-cfg.experts // REDUNDANT_SHARE)
    return -(-wanted // cfg.ranks) * cfg.ranks


def distances(cfg: BenchConfig) -> Distances:
    return Distances.from_nodes([r // (cfg.ranks // cfg.nodes) for r in range(cfg.ranks)])


def placement_for(system: str, cfg: BenchConfig, work: Workload) -> Placement:
    """The placement a row runs, from the batch's pairs per source rank and expert."""
    R, E = cfg.ranks, cfg.experts
    if system == UBEP_ROW:
        return Placement.identity(E, R)
    load_RE = torch.stack([torch.bincount(i[i >= 0], minlength=E) for i in work.topk_idx]).double()
    L = (E + redundant(cfg)) // R
    if system == "ubep+eplb":
        return eplb(load_RE, R, L, num_nodes=cfg.nodes, num_groups=EPLB_GROUPS)
    if system == "ubep+eplb-global":
        return eplb(load_RE, R, L)
    return balance(load_RE, distances(cfg), L)


def copy_map(system: str, p: Placement, rank: int, cfg: BenchConfig) -> CopyMap:
    if system != "ubep+placed":
        return CopyMap.load_only(p, rank)
    return CopyMap.nearest(p, rank, distances(cfg))


def stats(cfg: BenchConfig, work: Workload) -> dict[str, PlacementStats]:
    """Every row's rank loads and node crossings on this batch (the plain row included)."""
    out = {}
    for system in (UBEP_ROW, *systems(cfg)):
        p = placement_for(system, cfg, work)
        out[system] = measure(
            p, work.topk_idx, distances(cfg), cfg.hidden, work.xs[0].dtype, nearest=system == "ubep+placed"
        )
    return out


def open_placed(name: str, cfg: BenchConfig, work: Workload, tokens: int, stack: ExitStack) -> Calls:
    """A normal-mode Buffer of U physical experts for a placement row, checked once on its routing."""
    me, R = dist.get_rank(), cfg.ranks
    p = placement_for(name, cfg, work)
    maps = [copy_map(name, p, r, cfg) for r in range(R)]
    buf = stack.enter_context(
        ubep.Buffer(
            hidden=cfg.hidden,
            num_experts=p.num_physical,
            max_tokens_per_rank=max(tokens, 1),
            max_topk=cfg.topk,
            transport=HIER.name if cfg.nodes > 1 else SHM.name,
            timeout_s=cfg.timeout_s,
            **({"workers": cfg.workers, "schedule": cfg.schedule} if cfg.nodes == 1 else {}),
        )
    )
    x, idx, w = work.xs[me], work.topk_idx[me], work.topk_weights[me]
    if name == "ubep+placed":
        buf.set_placement(p)  # the Buffer maps logical ids to the nearest copy

        def send():
            return buf.dispatch(x, topk_idx=idx, topk_weights=w)
    else:  # a vLLM-style caller: it maps, the Buffer sees physical ids

        def send():
            return buf.dispatch(x, topk_idx=maps[me](idx), topk_weights=w)

    got = send()
    physical = [m(i) for m, i in zip(maps, work.topk_idx, strict=True)]
    want = reference.dispatch(work.xs, physical, work.topk_weights, p.num_physical)
    combined = buf.combine(got.recv_x, got.handle).combined_x
    ys = [e.recv_x_MH for e in want]
    if not (
        torch.equal(got.recv_x, want[me].recv_x_MH)
        and torch.equal(got.recv_topk_idx, want[me].recv_topk_idx_MK)
        and torch.equal(combined, reference.combine(ys, want, [t.shape[0] for t in work.xs])[me])
    ):
        raise AssertionError(f"{name}: dispatch or combine on rank {me} differs from the reference")
    return Calls(send, lambda: buf.combine(got.recv_x, got.handle))


def print_stats(cfg: BenchConfig, work_of: dict[int, Workload], rows) -> None:
    """Per batch size: each row's max / mean rank load, bytes across nodes and time, beside no placement."""
    from rich.console import Console
    from rich.measure import Measurement
    from rich.table import Table

    t = Table(title=f"placement: {redundant(cfg)} redundant slots, {cfg.nodes} emulated node(s)")
    for col in ("placement", "tokens", "max/mean load", "MB across nodes", "flat MB", "d+c us", "x none"):
        t.add_column(col, justify="left" if col == "placement" else "right", no_wrap=True)
    names = {v: k for k, v in SYSTEM_OF.items()}
    for tokens, work in work_of.items():
        got = stats(cfg, work)
        timed = {r.system: r for r in rows if r.tokens_per_rank == tokens}
        for system, s in got.items():
            row = timed.get(system)
            t.add_row(
                f"{names[system]} ({system})",
                str(tokens),
                f"{s.imbalance:.3f}",
                f"{s.cross_node_bytes / cfg.ranks / 1e6:.2f}",
                f"{s.cross_node_bytes_flat / cfg.ranks / 1e6:.2f}",
                "-" if row is None else f"{row.dispatch_us + row.combine_us:,.0f}",
                "-" if row is None or row.vs_ubep is None else f"{row.vs_ubep:.2f}",
            )
    console = Console()
    full = Measurement.get(console, console.options.update_width(1_000_000), t).maximum
    console = Console(width=max(full, console.width if console.is_terminal else 0))
    console.print(t)
    console.print(
        "[dim]load: (token, expert) pairs per rank; MB across nodes: dispatch + combine per rank and call, "
        "one row per (token, remote node) as the hier transport sends; flat: per (token, remote rank); "
        "x none: median over rounds of (dispatch + combine) over the plain ubep row's[/dim]"
    )

"""What a placement does to one batch: the rank loads and the bytes that cross nodes.

`measure` maps every rank's logical routing through that rank's copy map, then counts on the
physical routing: pairs per rank (the expert work each rank does), and the bytes of dispatch +
combine that cross a node boundary, per DeepEP's accounting (`across.collectives.bsp_hier.boundary_bytes`:
flat, one row per (token, remote rank); deduplicated, one per (token, remote node)).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ubep.across.collectives.bsp_hier import boundary_bytes
from ubep.layout import ExpertPlacement
from ubep.placement.copymap import CopyMap
from ubep.placement.distances import Distances
from ubep.placement.table import Placement


class PlacementStats(NamedTuple):
    """One placement on one batch (sums over all ranks)."""

    max_load: float  # pairs on the busiest rank
    mean_load: float  # pairs per rank
    cross_node_pairs: int  # (token, expert) pairs whose copy is on another node
    cross_node_bytes: int  # dispatch + combine bytes across nodes, deduplicated per (token, node)
    cross_node_bytes_flat: int  # the same, one row per (token, remote rank)

    @property
    def imbalance(self) -> float:
        """max / mean rank load (1.0 is perfect)."""
        return self.max_load / self.mean_load if self.mean_load else 1.0


def physical_routing(
    placement: Placement, topk_idxs: list[torch.Tensor], distances: Distances | None
) -> list[torch.Tensor]:
    """Every rank's routing as physical ids: nearest copies (`distances`), or load-only (None)."""
    maps = [
        CopyMap.load_only(placement, r) if distances is None else CopyMap.nearest(placement, r, distances)
        for r in range(placement.num_ranks)
    ]
    return [maps[r](idx) for r, idx in enumerate(topk_idxs)]


def measure(
    placement: Placement,
    topk_idxs: list[torch.Tensor],
    distances: Distances,
    hidden: int,
    dtype: torch.dtype = torch.bfloat16,
    nearest: bool = True,
) -> PlacementStats:
    """Loads and node crossings of every rank's logical routing under `placement` (nearest copies,
    or with `nearest=False` every copy alike, as a load-only balancer sends)."""
    phys = physical_routing(placement, topk_idxs, distances if nearest else None)
    rank_U = placement.rank_of_physical_U
    pairs = torch.cat([p.flatten() for p in phys])
    pairs = pairs[pairs >= 0]
    load_R = torch.bincount(rank_U[pairs], minlength=placement.num_ranks).double()
    node_R = torch.from_numpy(distances.node_of_rank())
    home = torch.cat(
        [
            torch.full((int((p >= 0).sum()),), r, dtype=torch.int64, device=p.device)
            for r, p in enumerate(phys)
        ]
    )
    crossing = int((node_R[home] != node_R[rank_U[pairs]]).sum())
    slots = ExpertPlacement.contiguous(placement.num_physical, placement.num_ranks)
    got = boundary_bytes(phys, slots, node_R.tolist(), hidden, dtype)
    return PlacementStats(
        max_load=float(load_R.max()),
        mean_load=float(load_R.mean()),
        cross_node_pairs=crossing,
        cross_node_bytes=sum(got["dispatch_bytes_dedup"]) + sum(got["combine_bytes_dedup"]),
        cross_node_bytes_flat=sum(got["dispatch_bytes_flat"]) + sum(got["combine_bytes_flat"]),
    )

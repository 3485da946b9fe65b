"""A Buffer's expert slots and the logical experts placed on them (`Buffer.set_placement`): the
check of a placement against the Buffer, and this rank's copy map.

    topk_idx (logical ids) -> [PlacedSlots.physical: CopyMap] -> topk_idx (slot ids) -> dispatch

Legend: see `ubep.placement`.
"""

from __future__ import annotations

import torch

from ubep.layout import ExpertPlacement
from ubep.placement.copymap import CopyMap
from ubep.placement.distances import Distances
from ubep.placement.table import Placement


class PlacedSlots:
    """The placement a Buffer holds (None: ids are the slots'), this rank's map to the nearest copy,
    and the last call before the placement changed (a cached dispatch from then is stale)."""

    def __init__(self, slots: ExpertPlacement):
        self.slots = slots
        self.placement: Placement | None = None
        self.copy_map: CopyMap | None = None
        self.changed_after = 0

    def check(self, placement: Placement | None) -> None:
        """ValueError where `placement` does not lay out this Buffer's slots, contiguously."""
        if placement is None:
            return
        if placement.num_ranks != self.slots.num_ranks or placement.num_physical != self.slots.num_experts:
            raise ValueError(
                f"placement lays out {placement.num_physical} slots on {placement.num_ranks} ranks; "
                f"this Buffer has {self.slots.num_experts} experts on {self.slots.num_ranks} ranks"
            )
        if not torch.equal(self.slots.rank_of_expert_E, placement.rank_of_physical_U):
            raise ValueError("set_placement needs the Buffer's default (contiguous) expert_placement")

    def digest(self) -> str | None:
        return None if self.placement is None else self.placement.digest()

    def hold(self, placement: Placement | None, seq: int, rank: int, node_of_rank: list[int]) -> None:
        """Hold `placement` from the call after `seq` on (every rank agreed on it)."""
        if (None if placement is None else placement.digest()) != self.digest():
            self.changed_after = seq  # older handles route to the old slots
        self.placement = placement
        self.copy_map = (
            None
            if placement is None
            else CopyMap.nearest(placement, rank, Distances.from_nodes(node_of_rank))
        )

    def physical(self, topk_idx: torch.Tensor) -> torch.Tensor:
        """topk_idx as slot ids: mapped through this rank's copy map when a placement is set."""
        return topk_idx if self.copy_map is None else self.copy_map(topk_idx)

    def check_num_experts(self, num_experts: int) -> None:
        """A call's num_experts: the logical count with a placement, else the Buffer's."""
        want = self.slots.num_experts if self.placement is None else self.placement.num_logical
        if num_experts != want:
            raise ValueError(f"num_experts is {num_experts}, the Buffer was built for {want}")

    def check_handle(self, dispatch_seq: int) -> None:
        """A cached dispatch's handle must come from after the latest change of placement."""
        if dispatch_seq <= self.changed_after:
            raise ValueError(
                "handle comes from a dispatch before set_placement changed the expert placement: "
                "its routing names the old slots; dispatch again with topk_idx"
            )

"""A Buffer's expert slots and the logical experts placed on them (`Buffer.set_placement`): the
check of a placement against the Buffer, and this rank's copy map.

    topk_idx (logical ids) -> [PlacedSlots.physical: CopyMap] -> topk_idx (slot ids) -> dispatch

Legend: see `ubep.placement`.
"""

from __future__ import annotations

import hashlib

import torch

from ubep.layout import ExpertPlacement
from ubep.placement.copymap import CopyMap
from ubep.placement.distances import Distances
from ubep.placement.table import Placement


class PlacedSlots:
    """The placement a Buffer holds (None: ids are the slots'), this rank's map to the nearest live
    copy, the last call before the placement changed (a cached dispatch from then is stale), and the
    map before the latest mask, for a low-latency combine whose dispatch used it."""

    def __init__(self, slots: ExpertPlacement, rank: int, node_of_rank: list[int]):
        self.slots, self.rank, self.node_of_rank = slots, rank, list(node_of_rank)
        self.placement: Placement | None = None
        self.copy_map: CopyMap | None = None
        self.changed_after = 0
        self.masked: frozenset[int] = frozenset()
        self.remapped_after = 0  # the last call whose dispatch mapped through `map_before`
        self.map_before: CopyMap | None = None

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

    @staticmethod
    def describe(placement: Placement | None) -> str:
        return "none" if placement is None else placement.digest()

    @staticmethod
    def fingerprint(placement: Placement | None) -> int:
        """`placement`'s digest as one int64 word (0: no placement), what staying ranks compare."""
        if placement is None:
            return 0
        return int(hashlib.sha1(placement.digest().encode()).hexdigest()[:15], 16) + 1

    def hold(self, placement: Placement | None, seq: int) -> None:
        """Hold `placement` from the call after `seq` on (every staying rank agreed on it)."""
        if (None if placement is None else placement.digest()) != self.digest():
            self.changed_after = seq  # older handles route to the old slots
        self.placement = placement
        self.copy_map, self.remapped_after = self._map(), 0  # older handles: as `changed_after` says

    def leave_out(self, masked: frozenset[int], seq: int) -> None:
        """From the call after `seq` on, map each logical expert to its nearest copy on a rank not
        `masked` (where it has one): a lost copy's tokens go to a live copy instead of being dropped."""
        if masked == self.masked:
            return
        self.masked, self.remapped_after, self.map_before = masked, seq, self.copy_map
        self.copy_map = self._map()

    def check_live(self, placement: Placement | None) -> None:
        """ValueError where `placement` leaves a logical expert with no copy on a staying rank: after a
        mask, a placement puts every expert on the staying ranks (the masked ranks' slots are never
        chosen, whatever they hold)."""
        if placement is None or not self.masked:
            return
        gone_U = torch.isin(
            placement.rank_of_physical_U, torch.tensor(sorted(self.masked), dtype=torch.int64, device="cpu")
        )
        live_E = torch.bincount(placement.logical_of_physical_U[~gone_U], minlength=placement.num_logical)
        if missing := (live_E == 0).nonzero().flatten().tolist():
            raise ValueError(
                f"placement puts logical expert(s) {missing[:8]} only on masked rank(s) "
                f"{sorted(self.masked)}: after a mask every expert needs a copy on a staying rank"
            )

    def _map(self) -> CopyMap | None:
        """This rank's map to the nearest copy on a staying rank, under the placement held."""
        if self.placement is None:
            return None
        distances = Distances.from_nodes(self.node_of_rank)
        return CopyMap.nearest(self.placement, self.rank, distances, masked=self.masked)

    def physical_at(self, topk_idx: torch.Tensor, seq: int) -> torch.Tensor:
        """topk_idx as slot ids, mapped as the dispatch of call `seq` mapped it (a low-latency combine
        repeats its dispatch's map, though a mask inside a call changed it since)."""
        copy_map = self.map_before if seq <= self.remapped_after else self.copy_map
        return topk_idx if copy_map is None else copy_map(topk_idx)

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

"""The logical-to-physical map applied before dispatch: each (token, expert) pair to a copy.

From one source rank, an expert's *nearest* copies are those at the smallest distance class
(the same rank, else the same node, else the nearest tier beyond); the pairs for that expert
are dealt round-robin over them, token by token and k ascending, starting at copy
`rank % count` so that the sources of one node do not all begin with the same copy. The
load-only balancers' choice (every copy alike, wherever the token is) is `CopyMap.load_only`.

The map runs as one compiled numba pass (`engine.numba_kernels.to_physical`) where numba is
installed, else as a few torch ops that give the same ids.

Example (copies of expert 0 on ranks 0 and 1 of node 0, rank 2 on node 1, rank 1's view):
pairs for expert 0 from rank 1 all go to rank 1's copy; from rank 3 (node 1) to rank 2's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ubep import validate
from ubep.placement.distances import Distances
from ubep.placement.table import Placement


def _compiled():
    """The numba kernel, or None where numba is not installed or the kernel fails its docstring's
    example (a compile error, a corrupt cached copy): the torch ops then give the same ids."""
    try:
        from ubep.engine import numba_kernels

        out = np.empty((3, 1), dtype=np.int64)
        args = (np.zeros((3, 1), dtype=np.int64), np.array([[4, 9]]), np.array([2]), 1, np.empty(1, np.int64))
        if numba_kernels.to_physical(*args, out) != numba_kernels.OK or out.ravel().tolist() != [9, 4, 9]:
            return None
    except Exception:  # ImportError without numba; numba's own errors otherwise
        return None
    return numba_kernels.to_physical


@dataclass(frozen=True, slots=True, eq=False)
class CopyMap:
    """One source rank's copy table: expert e's pairs go round-robin over near_EJ[e, :count_E[e]]."""

    near_EJ: torch.Tensor  # int64 [E, J], physical ids, -1 padded
    count_E: torch.Tensor  # int64 [E], >= 1
    start: int  # round-robin offset: the source rank
    kernel: object = field(default=None, repr=False)  # the compiled pass, or None: torch ops

    @classmethod
    def nearest(
        cls,
        placement: Placement,
        rank: int,
        distances: Distances,
        compiled: bool = True,
        masked: frozenset[int] = frozenset(),
    ) -> CopyMap:
        """Copies at the smallest distance class from `rank`, per logical expert, among the copies on
        ranks not `masked` (an expert with none of those keeps its copies: the masked rank's entries
        are then dropped, `ubep.membership.Membership.drop`)."""
        if distances.num_ranks != placement.num_ranks:
            raise ValueError(
                f"distances cover {distances.num_ranks} ranks, the placement {placement.num_ranks}"
            )
        phys_EJ = placement.physical_of_logical_EJ()
        rank_EJ = placement.rank_of_physical_U[phys_EJ.clamp(min=0)]
        valid_EJ = phys_EJ >= 0
        if masked:
            masked_R = torch.zeros(placement.num_ranks, dtype=torch.bool, device="cpu")
            masked_R[sorted(masked)] = True
            live_EJ = valid_EJ & ~masked_R[rank_EJ]
            valid_EJ = torch.where(live_EJ.any(dim=1, keepdim=True), live_EJ, valid_EJ)
        class_EJ = torch.from_numpy(distances.class_RR[rank])[rank_EJ].masked_fill(~valid_EJ, 1 << 30)
        near_EJ = class_EJ == class_EJ.min(dim=1, keepdim=True).values
        return cls._packed(phys_EJ, near_EJ, rank, compiled)

    @classmethod
    def load_only(cls, placement: Placement, rank: int, compiled: bool = True) -> CopyMap:
        """Every copy alike, wherever the token is (what a load-only balancer's map does)."""
        phys_EJ = placement.physical_of_logical_EJ()
        return cls._packed(phys_EJ, phys_EJ >= 0, rank, compiled)

    @classmethod
    def _packed(cls, phys_EJ: torch.Tensor, keep_EJ: torch.Tensor, rank: int, compiled: bool) -> CopyMap:
        """The kept physical ids of each row moved to its front (ascending), -1 after them."""
        order_EJ = torch.argsort((~keep_EJ).to(torch.int8), dim=1, stable=True)
        near_EJ = torch.where(keep_EJ, phys_EJ, -1).gather(1, order_EJ).contiguous()
        return cls(near_EJ, keep_EJ.sum(dim=1), int(rank), _compiled() if compiled else None)

    @property
    def num_logical(self) -> int:
        return self.count_E.numel()

    def __call__(self, topk_idx_NK: torch.Tensor) -> torch.Tensor:
        """int64 [N, K]: the physical ids of a logical routing (-1 stays -1); ValueError on an id
        outside [-1, E)."""
        idx_NK = validate.tensor("topk_idx", topk_idx_NK, torch.int64, 2).contiguous()
        out_NK = torch.empty_like(idx_NK)
        if self.kernel is not None:
            seen_E = np.empty(max(self.num_logical, 1), dtype=np.int64)
            args = (idx_NK.numpy(), self.near_EJ.numpy(), self.count_E.numpy(), self.start, seen_E)
            if self.kernel(*args, out_NK.numpy()) != -1:  # numba_kernels.OK
                raise validate.bad_expert(self.num_logical, int(seen_E[0]))
            return out_NK
        return self._torch(idx_NK)

    def _torch(self, idx_NK: torch.Tensor) -> torch.Tensor:
        """The same ids as the compiled pass, with torch ops: each pair's occurrence index among its
        expert's pairs (row-major) picks the copy."""
        flat_P = idx_NK.flatten()
        if flat_P.numel() and (flat_P.min() < -1 or flat_P.max() >= self.num_logical):
            found = int(flat_P.min()) if flat_P.min() < -1 else int(flat_P.max())
            raise validate.bad_expert(self.num_logical, found)
        order_P = torch.argsort(flat_P, stable=True)  # pairs grouped by expert, row-major inside a group
        sorted_P = flat_P[order_P]
        first_P = torch.searchsorted(sorted_P, sorted_P)  # where each pair's expert group begins
        occurrence_P = torch.empty_like(flat_P)
        occurrence_P[order_P] = (
            torch.arange(flat_P.numel(), dtype=torch.int64, device=flat_P.device) - first_P
        )
        e_P = flat_P.clamp(min=0)
        column_P = (self.start + occurrence_P) % self.count_E[e_P]
        out_P = torch.where(flat_P >= 0, self.near_EJ[e_P, column_P], -1)
        return out_P.view_as(idx_NK)

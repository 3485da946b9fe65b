"""`Placement`: which logical expert each physical slot holds, and the tables callers index.

Physical expert u lives on rank u // L as that rank's local expert u % L (L slots per rank),
the numbering vLLM's EPLB uses; a Buffer built with U = R * L experts and the default
contiguous placement therefore carries physical ids unchanged.

Example (E = 3 logical, R = 2 ranks, L = 2): logical_of_physical [0, 2, 1, 0] puts expert 0 on
both ranks; physical_of_logical_EJ = [[0, 3], [2, -1], [1, -1]], copies_E = [2, 1, 1].
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True, eq=False)
class Placement:
    """E logical experts on U = R * L physical slots; every logical expert has at least one copy."""

    num_ranks: int
    num_logical: int
    logical_of_physical_U: torch.Tensor  # int64 [U] (vLLM's phy2log for one layer)

    def __post_init__(self) -> None:
        U, R, E = self.logical_of_physical_U.numel(), self.num_ranks, self.num_logical
        if R < 1 or U % R:
            raise ValueError(f"placement: {U} physical experts do not split over {R} ranks")
        if self.logical_of_physical_U.dtype != torch.int64 or self.logical_of_physical_U.dim() != 1:
            raise ValueError("placement: logical_of_physical must be a 1-D int64 tensor")
        if U and (self.logical_of_physical_U.min() < 0 or self.logical_of_physical_U.max() >= E):
            raise ValueError(f"placement: logical expert ids must lie in [0, {E})")
        if (missing := (self.copies_E == 0).nonzero().flatten()).numel():
            raise ValueError(f"placement: logical expert(s) {missing.tolist()[:8]} have no copy")

    @classmethod
    def from_list(cls, logical_of_physical: list[int] | torch.Tensor, num_ranks: int, num_logical: int):
        return cls(
            num_ranks,
            num_logical,
            torch.as_tensor(logical_of_physical, dtype=torch.int64, device="cpu").flatten(),
        )

    @classmethod
    def identity(cls, num_logical: int, num_ranks: int) -> Placement:
        """One copy per expert, expert e on rank e // (E // R): no placement at all."""
        return cls(num_ranks, num_logical, torch.arange(num_logical, dtype=torch.int64, device="cpu"))

    @property
    def num_physical(self) -> int:
        return self.logical_of_physical_U.numel()

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.num_ranks

    @property
    def rank_of_physical_U(self) -> torch.Tensor:
        physical_U = torch.arange(
            self.num_physical, dtype=torch.int64, device=self.logical_of_physical_U.device
        )
        return physical_U // self.slots_per_rank

    @property
    def copies_E(self) -> torch.Tensor:
        """int64 [E]: copies of each logical expert (vLLM's logcnt)."""
        return torch.bincount(self.logical_of_physical_U, minlength=self.num_logical)

    def physical_of_logical_EJ(self) -> torch.Tensor:
        """int64 [E, J]: the physical ids of each logical expert, ascending, -1 padded (vLLM's log2phy)."""
        J = int(self.copies_E.max())
        device = self.logical_of_physical_U.device
        out_EJ = torch.full((self.num_logical, J), -1, dtype=torch.int64, device=device)
        order_U = torch.argsort(self.logical_of_physical_U, stable=True)  # physical ids by logical expert
        starts_E = torch.cumsum(self.copies_E, 0) - self.copies_E
        column_U = (
            torch.arange(self.num_physical, dtype=torch.int64, device=device)
            - starts_E[self.logical_of_physical_U[order_U]]
        )
        out_EJ[self.logical_of_physical_U[order_U], column_U] = order_U
        return out_EJ

    def local_logical(self, rank: int) -> torch.Tensor:
        """int64 [L]: the logical expert held by each of `rank`'s local slots (recv_topk_idx indexes it)."""
        L = self.slots_per_rank
        return self.logical_of_physical_U[rank * L : (rank + 1) * L]

    def logical_load(self, load_XU: torch.Tensor) -> torch.Tensor:
        """[..., E]: a load per physical slot ([..., U], such as `Buffer.stats().expert_load_E` under
        this placement) summed per logical expert."""
        if not isinstance(
            load_XU, torch.Tensor
        ):  # a list: int64 or float64 as numpy reads it, not the default
            load_XU = torch.from_numpy(np.asarray(load_XU))
        out_XE = torch.zeros(
            *load_XU.shape[:-1], self.num_logical, dtype=load_XU.dtype, device=load_XU.device
        )
        return out_XE.index_add_(-1, self.logical_of_physical_U, load_XU)

    def digest(self) -> str:
        """A short fingerprint of the whole placement (what ranks compare in `Buffer.set_placement`)."""
        text = f"{self.num_ranks}/{self.num_logical}/{self.logical_of_physical_U.tolist()}"
        sha1 = hashlib.sha1(text.encode()).hexdigest()[:12]
        return f"{self.num_physical} slots on {self.num_ranks} ranks, sha1 {sha1}"

    def as_dict(self) -> dict:
        """Plain data, for the agreement check of `Buffer.set_placement` and for JSON."""
        return {
            "num_ranks": self.num_ranks,
            "num_logical": self.num_logical,
            "logical_of_physical": self.logical_of_physical_U.tolist(),
        }

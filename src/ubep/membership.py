"""Which ranks take part in a Buffer's calls: the ranks masked out around a failure, the experts
they own, and from which call on older handles are stale.

    Buffer.mask_ranks(ranks) -> [Membership.mask] -> exchange.mask (agree on the call to resume from)
    every later call        -> [Membership.drop]  -> top-k entries of masked ranks' experts become -1

Legend: see `ubep.layout`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ubep.calls import CallCounter
from ubep.layout import ExpertPlacement
from ubep.protocols.base import Exchange, LowLatencyExchange


class Membership:
    """One rank's view of who is in: masked ranks, the experts they own (`masked_E` [E] bool on the
    Buffer's device), the last call before the latest mask (`after`), and whether this rank left."""

    def __init__(self, rank: int, placement: ExpertPlacement, device: torch.device):
        self.rank, self.num_ranks, self._owners_E = rank, placement.num_ranks, placement.rank_of_expert_E
        self.masked: frozenset[int] = frozenset()
        self.masked_E = torch.zeros(placement.num_experts, dtype=torch.bool, device=device)
        self.after = 0  # handles from calls up to this seq route through masked ranks
        self.retired = False  # this rank masked itself out

    def mask(
        self,
        ranks: Iterable[int],
        exchange: Exchange,
        low_latency: LowLatencyExchange | None,
        calls: CallCounter,
    ) -> None:
        """Leave `ranks` out of every later call; collective among the staying ranks (they agree, through
        the exchange, on the call to resume from). A rank that masks itself only retires."""
        gone = frozenset(int(r) for r in ranks)
        outside = sorted(r for r in gone if not 0 <= r < self.num_ranks)
        if outside:
            raise ValueError(f"ranks must lie in [0, {self.num_ranks}), got {outside}")
        if self.rank in gone:
            self.retired = True
            return
        seq = exchange.mask(self.masked | gone, calls.seq)
        calls.resume(seq)
        if low_latency is not None:
            low_latency.resume(seq)  # the calls before are over: their halves are free again
        self.masked |= gone
        masked = torch.tensor(sorted(self.masked), dtype=torch.int64, device=self._owners_E.device)
        self.masked_E = torch.isin(self._owners_E, masked).to(self.masked_E.device)
        self.after = seq

    def drop(self, topk_idx_NK: torch.Tensor, count: bool = True) -> tuple[torch.Tensor, int]:
        """topk_idx with -1 where it selects a masked rank's expert, and how many entries that drops
        (0 unless `count`: counting reads back on the host)."""
        if not self.masked:
            return topk_idx_NK, 0
        E = self.masked_E.numel()  # (ids outside [0, E) stay: on the device halves, the kernel rejects them)
        dropped_NK = (topk_idx_NK >= 0) & (topk_idx_NK < E) & self.masked_E[topk_idx_NK.clamp(0, E - 1)]
        return topk_idx_NK.masked_fill(dropped_NK, -1), int(dropped_NK.sum()) if count else 0

    def check_handle(self, dispatch_seq: int) -> None:
        """Handles from dispatches before the latest mask route through masked ranks: refused."""
        if dispatch_seq <= self.after:
            raise ValueError(
                f"handle comes from a dispatch before rank(s) {sorted(self.masked)} were masked; "
                "dispatch again to route around them"
            )

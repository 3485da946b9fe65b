"""Which ranks take part in a Buffer's calls: the ranks masked out around a failure, the experts
they own, and from which call on older handles are stale.

    Buffer.mask_ranks(ranks) -> [Membership.mask] -> exchange.mask (agree on the call to resume from)
    a call that meets a dead peer, on_peer_failure="mask"
                            -> [Membership.mask_failed] -> exchange.agree_to_mask (agree on whom)
    every later call        -> [Membership.drop]  -> top-k entries of masked ranks' experts become -1
                               [Membership.around] -> a handle's sends to masked ranks left out
    a call's start, ranks masked -> [Membership.admit] -> exchange.admissions / admit (a restarted
                               rank taken back in, at the call the leader announced)
    Buffer.rejoin (the restarted process) -> [Membership.join] -> exchange.join

Legend: see `ubep.layout`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from ubep.calls import CallCounter
from ubep.layout import ExpertPlacement
from ubep.protocols.base import Exchange, LowLatencyExchange
from ubep.results import DispatchHandle

# What a call does when it meets a dead or stopped peer (`Buffer(on_peer_failure=...)`): raise it
# (the caller masks and calls again), or mask it with the other staying ranks and finish the call.
RAISE, MASK = "raise", "mask"
ON_PEER_FAILURE = (RAISE, MASK)


class Membership:
    """One rank's view of who is in: masked ranks, the experts they own (`masked_E` [E] bool on the
    Buffer's device), the last call before the latest mask (`after`), and whether this rank left."""

    def __init__(self, rank: int, placement: ExpertPlacement, device: torch.device):
        self.rank, self.num_ranks, self._owners_E = rank, placement.num_ranks, placement.rank_of_expert_E
        self.masked: frozenset[int] = frozenset()
        self.masked_E = torch.zeros(placement.num_experts, dtype=torch.bool, device=device)
        self.after = 0  # the calls up to this seq are over: their deferred receive halves may not run
        self.stale_after = 0  # handles from dispatches up to this seq may not have completed on every rank
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
        self.after = self.stale_after = seq

    def mask_failed(
        self,
        error: Exception,
        exchange: Exchange,
        low_latency: LowLatencyExchange | None,
        calls: CallCounter,
        seq: int,
    ) -> frozenset[int]:
        """After call `seq` failed with `error` (on_peer_failure="mask"): agree with the staying ranks,
        inside the call, on whom to leave out, and leave them out. Returns the ranks masked now; empty
        where `error` is no peer's failure or the exchange cannot mask, so the caller raises it.

        Every staying rank failed the same call (the usual case: a peer's data is one flag that all
        see alike), so each finishes it again without them, and the handles before it stay good.
        Where some completed it, the call raises, the ranks masked all the same (as `mask_ranks`).
        """
        agreed = exchange.agree_to_mask(error, seq)
        if agreed is None:
            return frozenset()
        calls.resume(agreed.seq)
        if low_latency is not None:
            low_latency.resume(agreed.seq)  # the calls before are over: their halves are free again
        new = agreed.gone - self.masked
        self.masked = agreed.gone
        masked = torch.tensor(sorted(self.masked), dtype=torch.int64, device=self._owners_E.device)
        self.masked_E = torch.isin(self._owners_E, masked).to(self.masked_E.device)
        self.after = agreed.seq
        if not agreed.in_step:
            self.stale_after = agreed.seq
            return frozenset()
        return new

    def admit(
        self, exchange: Exchange, low_latency: LowLatencyExchange | None, calls: CallCounter, boundary: bool
    ) -> None:
        """At a call's start, ranks being masked: where `boundary` (a call that takes no handle: a
        dispatch routed anew, a low-latency dispatch), take back in the restarted ranks every staying
        rank admits before this call (`Heap.admissions`). All resume after the call before, so handles
        and pending receive halves from before are refused, as after a mask."""
        if not self.masked:
            return
        ranks = exchange.admissions(calls.seq + 1, boundary)
        if ranks:
            taken = exchange.admit(ranks, calls.seq + 1)  # none: a joiner died, masked again
            self._resume(self.masked - taken, calls.seq, low_latency, calls)

    def join(
        self,
        exchange: Exchange,
        low_latency: LowLatencyExchange | None,
        calls: CallCounter,
        deadline_s: float,
    ) -> None:
        """This process restarts a masked rank (`Buffer.rejoin`): join the staying ranks at the call
        they agree on, and take over their membership and call numbers."""
        agreed = exchange.join(deadline_s)
        self._resume(agreed.gone, agreed.seq, low_latency, calls)

    def _resume(
        self, masked: Iterable[int], seq: int, low_latency: LowLatencyExchange | None, calls: CallCounter
    ) -> None:
        calls.resume(seq)
        if low_latency is not None:
            low_latency.resume(seq)  # the calls before are over: their halves are free again
        self.masked = frozenset(masked)
        masked_R = torch.tensor(sorted(self.masked), dtype=torch.int64, device=self._owners_E.device)
        self.masked_E = torch.isin(self._owners_E, masked_R).to(self.masked_E.device)
        self.after = self.stale_after = seq

    def around(self, handle: DispatchHandle) -> DispatchHandle:
        """`handle` without its sends to masked ranks: a combine after a mask inside a call sums what
        the staying ranks return (the masked ranks' rows are left out, `left_out`)."""
        if not self.masked:
            return handle
        masked_R = torch.zeros(self.num_ranks, dtype=torch.bool, device=handle.send_counts_R.device)
        masked_R[sorted(self.masked)] = True
        if not bool((handle.send_counts_R[masked_R] > 0).any()):
            return handle
        return dataclasses.replace(
            handle,
            is_token_in_rank_NR=handle.is_token_in_rank_NR & ~masked_R.to(handle.is_token_in_rank_NR.device),
            send_counts_R=handle.send_counts_R.masked_fill(masked_R, 0),
        )

    def left_out(self, topk_idx_NK: torch.Tensor) -> torch.Tensor:
        """bool [N, K]: the entries of `topk_idx_NK` (physical expert ids) that select a masked rank's
        expert, on topk_idx's device."""
        E = self.masked_E.numel()  # (ids outside [0, E) stay: on the device halves, the kernel rejects them)
        return (topk_idx_NK >= 0) & (topk_idx_NK < E) & self.masked_E[topk_idx_NK.clamp(0, E - 1)]

    def drop(self, topk_idx_NK: torch.Tensor, count: bool = True) -> tuple[torch.Tensor, int]:
        """topk_idx with -1 where it selects a masked rank's expert, and how many entries that drops
        (0 unless `count`: counting reads back on the host)."""
        if not self.masked:
            return topk_idx_NK, 0
        dropped_NK = self.left_out(topk_idx_NK)
        return topk_idx_NK.masked_fill(dropped_NK, -1), int(dropped_NK.sum()) if count else 0

    def check_cached(self, handle: DispatchHandle) -> None:
        """A cached dispatch repeats its handle's rows whole: refused where they pass a masked rank
        (a mask inside a call keeps older handles for combine, not for this)."""
        if self.masked and self.masked.intersection(
            torch.nonzero((handle.send_counts_R > 0) | (handle.recv_counts() > 0)).flatten().tolist()
        ):
            raise ValueError(
                f"handle routes rows through rank(s) {sorted(self.masked)}, masked since its dispatch; "
                "dispatch again to route around them"
            )

    def check_handle(self, dispatch_seq: int) -> None:
        """Handles from dispatches before the latest `mask_ranks` may route through masked ranks, and
        may not have completed on every staying rank: refused."""
        if dispatch_seq <= self.stale_after:
            said = f"rank(s) {sorted(self.masked)} were masked" if self.masked else "ranks were taken back in"
            raise ValueError(f"handle comes from a dispatch before {said}; dispatch again to route anew")

"""Which ranks take part in a Buffer's calls: the ranks masked out around a failure, the experts
they own, and from which call on older handles are stale.

    Buffer.mask_ranks(ranks) -> [Membership.mask] -> exchange.mask (agree on the call to resume from)
    a call that meets a dead peer, on_peer_failure="mask"
                            -> [Membership.mask_failed] -> exchange.agree_to_mask (agree on whom)
    either mask             -> [quorum] a side that holds no quorum of the ranks that were in raises
                               PartitionError: a split never leaves two groups going on
    every later call        -> [Membership.drop]  -> top-k entries of masked ranks' experts become -1
                               [Membership.around] -> a handle's sends to masked ranks left out
    a call's start, ranks masked -> [Membership.admit] -> exchange.admissions / admit (a restarted
                               rank taken back in, at the call the leader announced)
    Buffer.rejoin (the restarted process) -> [Membership.join] -> exchange.join

Legend: see `ubep.layout`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch

from ubep.calls import CallCounter
from ubep.errors import PartitionError
from ubep.layout import ExpertPlacement
from ubep.protocols.base import Exchange, LowLatencyExchange
from ubep.results import DispatchHandle

# What a call does when it meets a dead or stopped peer (`Buffer(on_peer_failure=...)`): raise it
# (the caller masks and calls again), or mask it with the other staying ranks and finish the call.
RAISE, MASK = "raise", "mask"
ON_PEER_FAILURE = (RAISE, MASK)
# What a call that failed on a peer does once the staying ranks masked it (`Membership.mask_failed`):
# run again without the masked ranks, finish in place from what the staying ranks sent, or raise.
AGAIN, FINISH, GIVE_UP = "again", "finish", "give up"


def quorum(before: Iterable[int], stay: Iterable[int]) -> bool:
    """Whether the ranks `stay` may go on without the rest of `before` (the ranks in until now): they
    hold a strict majority of them, or exactly half and the lowest of them. Two sides of a split
    cannot both hold it, so at most one goes on; each side decides from its own ranks alone.

    Example: of 6 ranks in, 4 go on and 2 stop; of 4 ranks, {0, 1} go on and {2, 3} stop."""
    before, stay = frozenset(before), frozenset(stay) & frozenset(before)
    return 2 * len(stay) > len(before) or (2 * len(stay) == len(before) > 0 and min(before) in stay)


class Membership:
    """One rank's view of who is in: masked ranks, the experts they own (`masked_E` [E] bool on the
    Buffer's device), the last call before the latest mask (`after`), and whether this rank left."""

    def __init__(self, rank: int, placement: ExpertPlacement, device: torch.device):
        self.rank, self.num_ranks, self._owners_E = rank, placement.num_ranks, placement.rank_of_expert_E
        self.masked: frozenset[int] = frozenset()
        self.masked_E = torch.zeros(placement.num_experts, dtype=torch.bool, device=device)
        self.after = 0  # the calls up to this seq are over: their deferred receive halves may not run
        self.stale_after = 0  # handles from dispatches up to this seq may not have completed on every rank
        self.retired = False  # this rank masked itself out, or stopped on the losing side of a split
        self.retired_as = "masked itself out of its group"  # why, in the words of the calls it refuses

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
        self._check_quorum(self.masked | gone, "mask_ranks")
        seq = exchange.mask(self.masked | gone, calls.seq)
        self._resume(self.masked | gone, seq, low_latency, calls)

    def mask_failed(
        self,
        error: Exception,
        exchange: Exchange,
        low_latency: LowLatencyExchange | None,
        calls: CallCounter,
        seq: int,
        fresh: bool = False,
        unfinished: bool = False,
    ) -> str:
        """After call `seq` failed with `error` (on_peer_failure="mask"): agree with the staying ranks,
        inside the call, on whom to leave out, and leave them out. Returns what the call does next:
        AGAIN, FINISH, or GIVE_UP (raise `error`; also where it is no peer's failure, or the
        exchange cannot mask). `fresh`: the call takes no handle (a dispatch routed anew);
        `unfinished`: it is a low-latency combine whose receive half failed, its rows sent.

        Every staying rank failed the same call (the usual case: a peer's data is one flag that all
        see alike), so each runs it again without them (AGAIN), and the handles before it stay good.
        Some may have completed a low-latency combine that the others failed (the peer put rows
        into some homes only), and failed the next call, on the others' aborts: where that call is
        fresh, the ranks behind finish the combine in place from the rows the staying ranks put
        (FINISH, `LowLatencyExchange.finish_combine`) and the ranks ahead run theirs again (AGAIN),
        so every rank's calls return alike and stay in step. Otherwise, where some completed the
        call, it raises, the ranks masked all the same (as `mask_ranks`).
        """
        agreed = exchange.agree_to_mask(error, seq)
        if agreed is None:
            return GIVE_UP
        self._check_quorum(agreed.gone, getattr(error, "phase", "call"))
        new = agreed.gone - self.masked
        combine_behind = (
            low_latency is not None
            and low_latency.finishes_combine
            and agreed.seqs == {agreed.seq - 1, agreed.seq}
        )
        if not new:
            step = GIVE_UP  # nothing masked now: the call would fail again alike
        elif agreed.in_step:
            step = AGAIN
        elif combine_behind and seq == agreed.seq - 1 and unfinished:
            step = FINISH
        elif combine_behind and seq == agreed.seq and fresh and calls.kind_before == "ll_combine":
            step = AGAIN
        else:
            step = GIVE_UP
        stale = step == GIVE_UP and not agreed.in_step  # a handle may come from a call only some completed
        self._resume(agreed.gone, agreed.seq, low_latency, calls, stale=stale)
        return step

    def _check_quorum(self, gone: frozenset[int], phase: str) -> None:
        """PartitionError (and this rank retires) where the ranks that stay, `gone` left out, hold no
        quorum of the ranks in until now: the lost ranks may be alive on the other side of a split,
        going on there."""
        before = [r for r in range(self.num_ranks) if r not in self.masked]
        stay = [r for r in before if r not in gone]
        if quorum(before, stay):
            return
        self.retired = True
        self.retired_as = "stopped on the side of a split without a quorum (PartitionError)"
        lost = sorted(set(before) - set(stay))
        raise PartitionError(
            f"{phase}: rank {self.rank} stops: its side keeps rank(s) {stay} of the {len(before)} in, "
            f"having lost rank(s) {lost}; a side goes on only with a strict majority of the ranks in, "
            f"or exactly half of them including the lowest (rank {min(before)}), so that a split "
            "never leaves two groups going on",
            lost,
        )

    def admit(
        self, exchange: Exchange, low_latency: LowLatencyExchange | None, calls: CallCounter, boundary: bool
    ) -> bool:
        """At a call's start, ranks being masked: where `boundary` (a call that takes no handle: a
        dispatch routed anew, a low-latency dispatch), take back in the restarted ranks every staying
        rank admits before this call (`Heap.admissions`). All resume after the call before, so handles
        and pending receive halves from before are refused, as after a mask. Returns whether the
        membership changed (the caller's copy map then follows it)."""
        if not self.masked:
            return False
        ranks = exchange.admissions(calls.seq + 1, boundary)
        if not ranks:
            return False
        taken = exchange.admit(ranks, calls.seq + 1)  # none: a joiner died, masked again
        self._resume(self.masked - taken, calls.seq, low_latency, calls)
        return True

    def join(
        self,
        exchange: Exchange,
        low_latency: LowLatencyExchange | None,
        calls: CallCounter,
        deadline_s: float,
        stamp: Callable[[str], None],
    ) -> None:
        """This process restarts a masked rank (`Buffer.rejoin`): join the staying ranks at the call
        they agree on, and take over their membership and call numbers; `stamp` notes its stages."""
        agreed = exchange.join(deadline_s, stamp)
        self._resume(agreed.gone, agreed.seq, low_latency, calls)

    def _resume(
        self,
        masked: Iterable[int],
        seq: int,
        low_latency: LowLatencyExchange | None,
        calls: CallCounter,
        stale: bool = True,
    ) -> None:
        """Go on from call `seq` with `masked` left out; handles from before are refused where `stale`
        (a mask inside a call every staying rank failed alike keeps them good)."""
        calls.resume(seq)
        if low_latency is not None:
            low_latency.resume(seq)  # the calls before are over: their halves are free again
        self.masked = frozenset(masked)
        masked_R = torch.tensor(sorted(self.masked), dtype=torch.int64, device=self._owners_E.device)
        self.masked_E = torch.isin(self._owners_E, masked_R).to(self.masked_E.device)
        self.after = seq
        if stale:
            self.stale_after = seq

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

"""What every protocol shares: the call identity, the exchange interface, and the
control block each rank keeps in its shared segment (pid, abort word, barrier).

Legend: see `ubep.layout`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from ubep.calls import CallId
from ubep.doorbell import Doorbell
from ubep.errors import CommTimeoutError, PeerDataError, UbepError
from ubep.faults import NO_FAULTS, FaultPoints
from ubep.layout import ExpertPlacement
from ubep.results import DispatchHandle
from ubep.shm import SegmentLayout, SymmetricHeap
from ubep.waiting import AbortNotice, PeerAbortedError, Waiter

# Wire codes for the dtypes a payload may carry (stored next to the data).
DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float8_e4m3fn: 4, torch.uint8: 5}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
MAX_ITEMSIZE = 4  # bytes per element of the widest payload dtype (float32)

# Control block words (int64) at the start of every rank's segment: the pid, the
# barrier word, and a ring of abort notices, one per call (slot seq % ABORT_RING),
# so a notice outlives the rank's next calls: a slow peer still finds it there.
CTL_PID, CTL_BARRIER, CTL_ABORTS, ABORT_RING = 0, 2, 8, 16
CTL_WORDS = CTL_ABORTS + ABORT_RING
# Why a rank aborted a call; a notice packs (seq, cause, culprit + 1) into one word.
CAUSE_OWN, CAUSE_DEAD, CAUSE_SILENT, CAUSE_BAD_DATA = 0, 1, 2, 3
BLAME = {
    CAUSE_DEAD: "died",
    CAUSE_SILENT: "sent nothing before the deadline",
    CAUSE_BAD_DATA: "published data that failed its checks",
}
BARRIERS_PER_CALL = 16  # barrier targets are call.seq * this + step: ranks agree even after an abort


def pack_notice(seq: int, cause: int, culprit: int) -> int:
    return (seq << 24) | (cause << 16) | (culprit + 1)


def unpack_notice(word: int) -> tuple[int, int, int]:
    """(seq, cause, culprit) of a packed abort notice; culprit -1: none."""
    return word >> 24, (word >> 16) & 0xFF, (word & 0xFFFF) - 1


@dataclass(frozen=True, slots=True)
class SendPlan:
    """The sender's side of one dispatch, from the layout."""

    x_NH: torch.Tensor
    topk_idx_NK: torch.Tensor | None  # None: cached dispatch (routing from the handle)
    topk_weights_NK: torch.Tensor | None
    is_token_in_rank_NR: torch.Tensor
    send_counts_R: torch.Tensor  # int64 [R]


@dataclass(frozen=True, slots=True)
class Received:
    """The receiver's side of one dispatch; rows in source-rank-then-token order."""

    recv_x_MH: torch.Tensor
    recv_topk_idx_MK: torch.Tensor | None
    recv_topk_weights_MK: torch.Tensor | None
    recv_src_token_M: torch.Tensor  # int64
    recv_prefix_R1: torch.Tensor  # int64 [R + 1]
    recv_home_offset_R: torch.Tensor | None = None  # see DispatchHandle
    route: object | None = None  # see DispatchHandle


class Exchange(Protocol):
    """A protocol bound to a transport: the two halves of an EP layer's traffic."""

    name: str

    def dispatch(self, call: CallId, plan: SendPlan, handle: DispatchHandle | None) -> Received: ...

    def combine(
        self, call: CallId, x_MH: torch.Tensor, handle: DispatchHandle, topk_weights_MK: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def abort(self, call: CallId) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class Sizing:
    """Shapes every rank agreed on at construction."""

    hidden: int
    capacity: int  # T: most tokens a rank passes to one call
    max_topk: int
    placement: ExpertPlacement

    @property
    def num_ranks(self) -> int:
        return self.placement.num_ranks

    @property
    def row_bytes(self) -> int:
        return self.hidden * MAX_ITEMSIZE


def new_layout() -> SegmentLayout:
    """A segment layout that starts with the control block every protocol needs."""
    layout = SegmentLayout()
    layout.add("ctl", (CTL_WORDS,), torch.int64)
    return layout


class ShmPeers:
    """The symmetric heap plus the control block: liveness, aborts and barriers."""

    def __init__(
        self,
        layout: SegmentLayout,
        group: dist.ProcessGroup,
        rank: int,
        sizing: Sizing,
        timeout_s: float,
        faults: FaultPoints = NO_FAULTS,
    ):
        if "ctl" not in layout.regions:
            raise ValueError("segment layouts must come from new_layout() (they need a control block)")
        self.rank = rank
        self.num_ranks = sizing.num_ranks
        self.sizing = sizing
        self.timeout_s = timeout_s
        self.faults = faults
        self.heap = SymmetricHeap(layout, group, rank, self.num_ranks)
        self.doorbell = Doorbell(self.heap.names[rank])
        self.doorbell.connect(self.heap.names)
        self._ctl = [self.heap.words(r, "ctl") for r in range(self.num_ranks)]
        self._ctl[rank][CTL_PID] = os.getpid()
        dist.barrier(group=group)  # every pid and doorbell is ready before the first wait
        self._pids = [int(c[CTL_PID]) for c in self._ctl]
        self._current_seq = 0
        self._barrier_seq = 0
        self._barrier_step = 0

    def waiter(self, phase: str, call: CallId) -> Waiter:
        self._current_seq = call.seq
        return Waiter(
            phase,
            self.timeout_s,
            self._pids.__getitem__,
            self._aborted,
            self.doorbell.wait,
            lambda error: self._gave_up(call, error),
        )

    def _notice(self, peer: int, seq: int) -> tuple[int, int] | None:
        """(cause, culprit) if `peer` aborted call `seq`, else None."""
        got_seq, cause, culprit = unpack_notice(int(self._ctl[peer][CTL_ABORTS + seq % ABORT_RING]))
        return (cause, culprit) if got_seq == seq else None

    def _aborted(self, peer: int) -> AbortNotice | None:
        """Peer's notice if it aborted the current call (words read from a peer: checked)."""
        found = self._notice(peer, self._current_seq)
        if found is None:
            return None
        cause, culprit = found
        if cause not in BLAME or not 0 <= culprit < self.num_ranks:
            return AbortNotice("it rejected its input or failed; see that rank's error")
        return AbortNotice(f"it gave up because rank {culprit} {BLAME[cause]}", culprit, cause)

    def _gave_up(self, call: CallId, error: UbepError) -> None:
        """A wait of ours failed: pass the blame on, so peers waiting on us fail fast too."""
        if isinstance(error, CommTimeoutError):
            blamed = error.dead_peers or error.peers
            self.abort(call, CAUSE_DEAD if error.dead_peers else CAUSE_SILENT, blamed[0])
        elif isinstance(error, PeerAbortedError) and error.culprit is not None:
            self.abort(call, error.notice.cause, error.culprit)
        else:
            self.abort(call)

    def bad_data(self, call: CallId, culprit: int, message: str) -> PeerDataError:
        """Blame `culprit` for a value that failed a bounds check (peers learn it); the error to raise."""
        self.abort(call, CAUSE_BAD_DATA, culprit)
        return PeerDataError(message)

    def abort(self, call: CallId, cause: int = CAUSE_OWN, culprit: int = -1) -> None:
        """Tell peers waiting on `call` that this rank will not take part (first cause wins)."""
        if self._notice(self.rank, call.seq) is None:
            self._ctl[self.rank][CTL_ABORTS + call.seq % ABORT_RING] = pack_notice(call.seq, cause, culprit)
            self.doorbell.ring_all(self.rank)

    def barrier(self, phase: str, call: CallId) -> None:
        """A global barrier over shared memory: each rank raises its counter, waits for all.

        The target derives from the call and the barrier's place in it, not from
        a running count, so a call that some ranks abandoned cannot shift later barriers.
        A peer that abandoned this call and went on to later barriers has passed the
        target without arriving: its abort notice keeps it pending (the waiter raises).
        """
        if call.seq != self._barrier_seq:
            self._barrier_seq, self._barrier_step = call.seq, 0
        self._barrier_step += 1
        if self._barrier_step >= BARRIERS_PER_CALL:
            raise RuntimeError(f"{phase}: more than {BARRIERS_PER_CALL - 1} barriers in one call")
        target = call.seq * BARRIERS_PER_CALL + self._barrier_step
        self._ctl[self.rank][CTL_BARRIER] = target
        self.doorbell.ring_all(self.rank)
        waiter = self.waiter(phase, call)
        pending = [r for r in range(self.num_ranks) if r != self.rank]
        while pending:
            pending = [r for r in pending if self._ctl[r][CTL_BARRIER] < target or self._notice(r, call.seq)]
            if pending:
                waiter.pause(pending)

    def wait_words(self, phase: str, call: CallId, flags: list, value: int, peers: list[int]) -> None:
        """Wait until flags[p][()] == value for every p in `peers` (flags: per-peer 0-d views)."""
        waiter = self.waiter(phase, call)
        pending = list(peers)
        while pending:
            pending = [p for p in pending if flags[p][()] != value]
            if pending:
                waiter.pause(pending)

    def ring(self, peer: int) -> None:
        """Wake `peer` if it waits: call after writing a stamp it may be waiting for."""
        self.doorbell.ring(peer)

    def ring_all(self) -> None:
        self.doorbell.ring_all(self.rank)

    def close(self) -> None:
        self._ctl = []
        self.doorbell.close()
        self.heap.close()

"""Call identity: every collective call of a Buffer gets a number all ranks agree on.

Every rank makes the same sequence of calls, so `seq` (all calls) and `epoch`
(this kind's calls) agree across the group without any message. The epoch
stamps headers, so buffers never need clearing, and its parity picks the half
of a double-buffered region.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ubep.timers import BlockTimes, CallTimers

KINDS = {
    "dispatch": 1,
    "combine": 2,
    "ll_dispatch": 3,
    "ll_combine": 4,
    "mask": 5,
}  # each kind's code on the wire
METHODS = {1: "dispatch", 2: "combine", 3: "low_latency_dispatch", 4: "low_latency_combine", 5: "mask_ranks"}


@dataclass(frozen=True, slots=True)
class CallId:
    """Identity of one collective call: `seq` counts every call, `epoch` this kind's calls."""

    seq: int
    epoch: int
    kind: str = ""  # "dispatch", "combine", ...: what the peers are doing in this call
    # where the layers below charge this call's blocks (`ubep.timers`); None unless timers are on
    timers: BlockTimes | None = field(default=None, compare=False, repr=False)

    @property
    def parity(self) -> int:
        return self.epoch % 2

    def exact(self) -> CallId:
        """This call with an epoch no other call has (2 seq + the per-kind parity), for stamps that
        pair this very call on every rank and never a peer's next call of the kind, in the half
        the per-kind epoch chose."""
        return CallId(self.seq, 2 * self.seq + self.parity, self.kind, self.timers)


@dataclass(slots=True)
class CallCounter:
    """Per-Buffer call numbering; a rejected call consumes its number like any other."""

    seq: int = 0
    epochs: dict[str, int] = field(default_factory=dict)
    base: int = 0  # every kind's epoch before its first call (from `resume`)
    timers: CallTimers | None = None  # the Buffer's call timers, when on: each call starts its kind's
    kind: str = ""  # the kind of the latest call numbered
    kind_before: str = ""  # and of the one numbered before it (`Membership.mask_failed` asks)

    def next(self, kind: str) -> CallId:
        self.seq += 1
        self.kind_before, self.kind = self.kind, kind
        self.epochs[kind] = self.epochs.get(kind, self.base) + 1
        times = None if self.timers is None else self.timers.begin(kind)
        return CallId(self.seq, self.epochs[kind], kind, times)

    def resume(self, seq: int) -> None:
        """Continue after call `seq`, with every kind's epoch after it too: ranks that agreed on `seq`
        (after masking a dead rank) agree on every later call, and no epoch repeats an earlier one."""
        self.seq = self.base = seq
        self.epochs.clear()

"""The transport interface: where memory lives, how peers are reached and waited for.

    routing -> layout -> schedule -> protocol -> engine -> [transport]

A protocol declares its memory once, as typed regions and stamped headers
(`Region`, `Header`), and then only asks the transport for views of a peer's
region, to publish a header, and to wait for peers' headers to land. It never
sees a segment, a byte offset, a header word index or a doorbell.

Three implementations share this interface:
- `ubep.transport.heap.Heap` over shared segments (`ubep.transport.shm`): ranks
  are processes of one host, each mapping every rank's segment;
- the same `Heap` over a virtual world (`ubep.transport.virtual`): R ranks'
  memory in one address space, each rank a thread of one process (tests,
  single-device measurements);
- the CUDA heap (torch symmetric memory), where the kernels reach peers
  through a pointer table.

Publication order: payload first, stamp last. A header's first word is its
stamp, the call's epoch; the reader waits for the exact epoch, so buffers never
need clearing, and a double-buffered region's half is the epoch's parity.

Legend: see `ubep.layout`.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np
import torch

from ubep.calls import CallId
from ubep.errors import PeerDataError

PAGE_BYTES = mmap.PAGESIZE  # what a shared segment's memory is taken in: a page, once touched


@dataclass(frozen=True, slots=True)
class Region:
    """A named block that every rank's memory holds at the same place.

    `double`: two halves, one per epoch parity, so call e + 1 can be written
    while a slow peer still reads call e. `touch`: the most bytes of one half that one
    call can write or read, whole pages counted (`run_bytes`; the half's size caps it),
    where the protocol knows a bound below the whole half (None: all of it). On a host's shared segments an
    untouched page costs nothing; construction checks room for the touchable bytes.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    double: bool = False
    touch: int | None = None


def run_bytes(items: int, item_bytes: int, runs: int) -> int:
    """The most bytes of whole pages that `items` items of `item_bytes`, laid in at most `runs`
    runs each starting anywhere, can reach: a run of n items spans at most ceil(n * item_bytes /
    page) + 1 pages, which is at most n * item_bytes / page + 2, so all of them at most
    items * item_bytes + 2 * runs pages' bytes. Example: 4 items of 1,000 bytes in 2 runs on
    4 KiB pages: 4,000 + 2 * 2 * 4,096 = 20,384 bytes (each run of 2,000 bytes can straddle a
    page boundary: 4 pages, 16,384 bytes, at most)."""
    return items * item_bytes + 2 * runs * PAGE_BYTES


@dataclass(frozen=True, slots=True)
class Field:
    """One named entry of a header: one int64 word (read as an int), or `length` words (read as an
    array), each checked to lie in [lo, hi] on read."""

    name: str
    length: int | None = None  # None: a scalar
    lo: int = 0
    hi: int | None = None  # None: not checked
    says: str = ""  # what a bad value means, e.g. "announced {value} tokens, capacity is {hi}"

    @property
    def words(self) -> int:
        return 1 if self.length is None else self.length


@dataclass(frozen=True, slots=True)
class Header:
    """A stamped record of int64 words: word 0 is the stamp, then the fields in order.

    `inbox=False`: each rank publishes its own record in its own memory; peers
    read it there (the pattern of a get). `inbox=True`: the owner's memory holds
    one record per writer, and peers publish into it (the pattern of a put).
    """

    name: str
    fields: tuple[Field, ...] = ()
    inbox: bool = False
    double: bool = True
    phase: str = ""  # the call phase errors name (default: the header's name)

    @property
    def words(self) -> int:
        return 1 + sum(f.words for f in self.fields)

    def word(self, name: str) -> int:
        """The index of field `name`'s first word (word 0 is the stamp): where compiled halves,
        which index words rather than names, find it."""
        at = 1
        for f in self.fields:
            if f.name == name:
                return at
            at += f.words
        raise KeyError(f"header {self.name!r} has no field {name!r}")


Record = Mapping[str, "int | np.ndarray"]  # a header's fields as read: ints, or int64 arrays for length > 1


class Agreement(NamedTuple):
    """What the staying ranks agreed on inside a failed call (`Transport.agree_to_mask`).

    gone:    every rank left out from now on (those masked before included).
    seq:     the largest call any staying rank failed in; they all continue after it.
    in_step: every staying rank failed that same call, so each can finish it again without the
             ranks in `gone` (False: some completed it, so it cannot be finished in step).
    seqs:    the call each staying rank failed (`Membership.mask_failed` tells from them whether
             the ranks behind can finish their call in place and the ranks ahead run theirs again).
    """

    gone: frozenset[int]
    seq: int
    in_step: bool
    seqs: frozenset[int] = frozenset()


class Transport(Protocol):
    """One rank's access to every rank's memory, with the waits a protocol needs."""

    rank: int
    num_ranks: int
    live: tuple[int, ...]  # the ranks taking part, ascending (all of them until some are masked)

    def view(self, region: Region, owner: int, call: CallId | None = None) -> torch.Tensor:
        """Region of rank `owner`'s memory, as a tensor of its shape and dtype (the half of
        `call`'s parity for a double-buffered region)."""

    def publish(
        self, header: Header, call: CallId, values: Mapping[str, int | Iterable[int]], to: int | None = None
    ) -> None:
        """Write `values` into a header, then its stamp (the call's epoch), then wake its readers.

        Own record (to=None) for a plain header; this rank's row in `to`'s memory for an inbox.
        Everything written before this call (payload) is visible to a reader that sees the stamp.
        """

    def arrivals(self, header: Header, call: CallId, peers: Iterable[int], phase: str) -> Iterator[list[int]]:
        """Like `landed`, but yields every peer found landed at one look together (in `peers`' order), so
        one kernel can take all of them."""

    def landed(self, header: Header, call: CallId, peers: Iterable[int], phase: str) -> Iterator[int]:
        """Yield each of `peers` once, as its header for `call` lands, in arrival order.

        Waits yield the CPU; raises CommTimeoutError naming the silent (or dead)
        peers at the deadline, PeerAbortedError when a pending peer aborted the call.
        For an inbox, peer p's record is row p in this rank's memory.
        """

    def wait_landed(self, header: Header, call: CallId, peers: Iterable[int], phase: str) -> None:
        """Return once every one of `peers`' headers for `call` has landed (`landed`'s waits and checks)."""

    def stamped(self, header: Header, call: CallId, peer: int) -> bool:
        """Whether `peer`'s header for `call` has landed (no wait)."""

    def read(self, header: Header, call: CallId, peer: int) -> Record:
        """A landed header's fields, each bounds-checked (PeerDataError blames `peer`)."""

    def read_all(self, header: Header, call: CallId, peers: Sequence[int]) -> Record:
        """Several landed headers at once: each field as an int64 array with one row per peer
        (in `peers`' order), bounds-checked in one pass (PeerDataError blames the first bad peer)."""

    def wait(self, phase: str, call: CallId, peers: Iterable[int], ready: Callable[[int], bool]) -> None:
        """Wait until ready(p) for every p in peers, under the same deadline and checks as `landed`."""

    def words(self, region: Region, owner: int) -> np.ndarray:
        """An int64 region of `owner`'s memory as numpy words (counters other ranks poll)."""

    def ring(self, peer: int | None = None) -> None:
        """Wake `peer` (None: every peer) after writing a word it may be waiting for."""

    def barrier(self, phase: str, call: CallId) -> None:
        """Every rank arrives before any leaves (the BSP baseline's synchronisation)."""

    def begin(self, call: CallId) -> None:
        """Record that this rank began `call`, first in every call; a wait that goes on raises
        PeerDataError on finding a peer whose call of the same seq is another (kind, per-kind
        number): the ranks' call sequences differ."""

    def check_in_step(self, call: CallId, phase: str) -> None:
        """Raise that PeerDataError now if a live peer began another call of `call`'s seq (for a
        protocol whose barriers let mismatched calls pass, before it blames missing data)."""

    def abort(self, call: CallId, cause: int = 0, culprit: int = -1) -> None:
        """Tell peers waiting on `call` that this rank will not take part (first cause wins)."""

    def bad_data(self, call: CallId, culprit: int, message: str) -> PeerDataError:
        """Blame `culprit` for a value that failed a check (peers learn it); the error to raise."""

    def mask(self, ranks: Collection[int], seq: int) -> int:
        """Collective among the ranks that stay: leave `ranks` (all of them, those masked before
        included) out of every later wait and barrier.

        `seq` is the last call this rank started; returns the largest any staying
        rank started, after which they all continue.
        """

    def agree_to_mask(self, error: Exception, seq: int) -> Agreement | None:
        """Collective among the ranks that stay, run by each inside call `seq` after it failed with
        `error`: None where `error` is no peer's failure (bad data, a rejected input); else the
        ranks agree on the union of the ranks each of them found dead, stopped or silent past the
        deadline, and leave them out of every later wait and barrier."""

    def agree(self, value: int, phase: str) -> dict[int, int]:
        """Collective among the staying ranks, between calls (`set_placement` after a mask): every
        staying rank's `value`, by rank, within the deadline; the masked ranks take no part."""

    def admissions(self, seq: int, boundary: bool) -> frozenset[int]:
        """Before call `seq`, ranks being masked: where `boundary` (a call that takes no handle), the
        masked ranks whose restarted processes asked to come back and that every staying rank takes
        in before this call (the leader announced it)."""

    def admit(self, ranks: Collection[int], seq: int) -> frozenset[int]:
        """Collective among the staying ranks and the joiners `ranks`, before call `seq`: take them
        back in; all resume after seq - 1. Returns those taken in (none: a joiner died meanwhile)."""

    def join(self, deadline_s: float, stamp: Callable[[str], None]) -> Agreement:
        """Run by a process restarted in a masked rank's place: ask to come back, agree with the
        staying ranks at the call they choose; returns the ranks still masked and the seq all resume
        after. `stamp(stage)` notes when each of its waits ended (`Rejoining.stamp`)."""

    def check_member(self, phase: str, peers: Iterable[int] | None = None) -> None:
        """Raise MaskedOutError if a peer (default: every live one) masked this rank: it stalled and
        the others went on without it. Called before writing into peers' memory (they reuse it for
        other calls now) and after reading it, before returning what was read: a peer masks this
        rank before it overwrites anything, so reads that pass this check were whole."""

    def close(self) -> None:
        """Release this rank's memory and wake-up channel; idempotent."""

"""The memory low-latency mode declares, once: double-buffered slots per (local expert, source),
headers stamped per writer, and each rank's reuse words.

Every form of the protocol reads its places from here: the torch statement
(`ubep.protocols.ll.exchange`) through the `Header` and `Region` names, the
numba and Triton halves through the block indices and record words below (their
address table is `LLBlocks.table()`, in `TABLE` order).

Legend: see `ubep.protocols.ll.plans`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ubep.protocols.base import CODE_RANGE, Sizing
from ubep.protocols.ll.plans import per_writer
from ubep.transport.base import Field, Header, Region, run_bytes

# `done[kind, half, word]`: CONSUMED, the last call of that kind whose receive half
# finished (or that this rank rejected) on that half; SKIPPED, a rejected call whose
# half was still held by an older call, released when that older call is consumed.
DISPATCH, COMBINE = 0, 1
CONSUMED, SKIPPED = 0, 1
KINDS = {"dispatch": DISPATCH, "combine": COMBINE}

TABLE = ("sent", "slots", "slot_info", "returned", "back_slots", "done", "rejected")  # the halves' table
SENT, SLOTS, SLOT_INFO, RETURNED, BACK_SLOTS, DONE_WORDS, REJECTED = range(len(TABLE))
# Inbox record words: the stamp, then sent's dtype, T, width, counts[L]; returned's dtype, count.
SENT_FIELDS = ("dtype", "T", "width", "counts")
S_DTYPE, S_T, S_WIDTH, S_COUNTS = range(1, 1 + len(SENT_FIELDS))
RETURNED_FIELDS = ("dtype", "count")
R_DTYPE, R_COUNT = range(1, 1 + len(RETURNED_FIELDS))


@dataclass(frozen=True, slots=True)
class LLBlocks:
    """The memory low-latency mode declares (double-buffered slots, headers stamped per writer)."""

    sent: Header  # inbox, dispatch: per source, its per-expert counts, dtype, T and row width
    slots: Region  # uint8 [R, L, T, row bytes]: rows from each source, per local expert
    slot_info: Region  # int64 [R, L, T]: token * max_topk + k of each row
    returned: Header  # inbox, combine: per expert rank, dtype and row count
    back_slots: Region  # uint8 [R, T * min(max_topk, L), row bytes]: each expert rank's returned rows
    done: Region  # int64 [2, 2, 2]: see CONSUMED / SKIPPED
    rejected: Region  # int64 [2]: per kind, the last call this rank rejected

    @classmethod
    def of(cls, s: Sizing, in_word: bool = False) -> LLBlocks:
        """The blocks for this sizing; `in_word`: slot rows hold every 4 bytes as an 8-byte word
        (payload and epoch), twice the bytes.

        What one call touches of a half of `slots` (and of `slot_info`, 8 bytes a row): source s
        writes the rows of local expert j at [s, j, 0:count), and the receiver reads exactly those.
        Each of s's at most T tokens selects at most min(K, L) of this rank's L experts (never one
        twice), so s writes at most T * min(K, L) rows, in at most min(L, T * min(K, L)) runs from
        the start of a (source, expert) block: `run_bytes` of R times that, full-width (float32)
        rows, never more than the half. DeepSeek-V3 at 8 ranks (T 128, K 8, L 32): a quarter of
        the half. That is one call's bound: the pages calls touched stay taken, so calls whose
        routing moves between experts can take up to the whole half over a Buffer's life
        (docs/reliability.md, "Footprint")."""
        R, T, K, L, B = s.num_ranks, s.capacity, s.max_topk, s.placement.num_local_experts, s.row_bytes
        S = 2 * B if in_word else B  # bytes of a slot row
        rows, runs = R * T * min(K, L), R * min(L, T * min(K, L))  # one call, into a half (above)
        dtype = Field("dtype", lo=CODE_RANGE[0], hi=CODE_RANGE[1])
        return cls(
            sent=Header(
                "ll.sent",
                (dtype, Field("T", hi=T), Field("width", hi=B), Field("counts", length=L, hi=T)),
                inbox=True,
            ),
            slots=Region("ll.slots", (R, L, T, S), torch.uint8, True, touch=run_bytes(rows, S, runs)),
            slot_info=Region("ll.slot_info", (R, L, T), torch.int64, True, touch=run_bytes(rows, 8, runs)),
            returned=Header("ll.returned", (dtype, Field("count", hi=T * K)), inbox=True),
            back_slots=Region("ll.back_slots", (R, per_writer(s), S), torch.uint8, double=True),
            done=Region("ll.done", (2, 2, 2), torch.int64),
            rejected=Region("ll.rejected", (2,), torch.int64),
        )

    def table(self) -> tuple[Region | Header, ...]:
        """The blocks of the halves' address table, in `TABLE` order."""
        return tuple(getattr(self, name) for name in TABLE)

    def all(self) -> tuple[Region | Header, ...]:
        """Every block, for the heap's layout."""
        return self.table()

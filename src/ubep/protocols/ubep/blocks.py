"""The memory the UBEP protocol declares, once: every rank holds all of it, double-buffered.

Every form of the protocol reads its places from here: the torch statement
(`ubep.protocols.ubep.exchange`) through the `Header` and `Region` names, the
numba and Triton halves through the block indices and header words below (their
address table is `UbepBlocks.table()`, in `TABLE` order; the combine's blocks have
a table of their own, `ubep.protocols.combine.blocks`).

Legend: see `ubep.layout`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ubep import fp8
from ubep.protocols.base import CODE_RANGE, Sizing
from ubep.protocols.combine.blocks import BackBlocks
from ubep.transport.base import Field, Header, Region

TABLE = ("route", "data", "topk", "weights", "lists", "x", "scales")  # the dispatch halves' table
ROUTE, DATA, TOPK, WEIGHTS, LISTS, X, SCALES = range(len(TABLE))
# Route header words: the stamp, then num_tokens, dtype, topk, counts[R].
ROUTE_FIELDS = ("num_tokens", "dtype", "topk", "counts")
R_NUM, R_DTYPE, R_TOPK, R_COUNTS = range(1, 1 + len(ROUTE_FIELDS))


@dataclass(frozen=True, slots=True)
class UbepBlocks:
    """The memory the protocol declares (each rank holds all of it, double-buffered)."""

    route: Header
    data: Header
    topk: Region  # int64 [T, max_topk]: own routing, global expert ids
    weights: Region  # float32 [T, max_topk]
    lists: Region  # int64 [R, T]: tokens for each destination, ascending
    x: Region  # uint8 [T, row bytes]: own tokens (FP8: their values)
    scales: Region  # float32 [T, H // 128]: FP8 scales of own tokens
    back: BackBlocks  # combine: output rows, published once

    @classmethod
    def of(cls, s: Sizing) -> UbepBlocks:
        R, T, K, B = s.num_ranks, s.capacity, s.max_topk, s.row_bytes
        codes = CODE_RANGE
        return cls(
            route=Header(
                "ubep.route",
                (
                    Field("num_tokens", hi=T, says="announced {value} tokens, capacity is {hi}"),
                    Field("dtype", lo=codes[0], hi=codes[1]),
                    Field("topk", hi=K),
                    Field("counts", length=R, hi=T, says="announced {value} tokens, capacity is {hi}"),
                ),
                phase="dispatch",
            ),
            data=Header("ubep.data"),
            topk=Region("ubep.topk", (T, K), torch.int64, double=True),
            weights=Region("ubep.weights", (T, K), torch.float32, double=True),
            lists=Region("ubep.lists", (R, T), torch.int64, double=True),
            x=Region("ubep.x", (T, B), torch.uint8, double=True),
            scales=Region("ubep.scales", (T, s.hidden // fp8.BLOCK), torch.float32, double=True),
            back=BackBlocks.of("ubep", s, double=True),
        )

    def table(self) -> tuple[Region | Header, ...]:
        """The blocks of the dispatch halves' address table, in `TABLE` order."""
        return tuple(getattr(self, name) for name in TABLE)

    def all(self) -> tuple[Region | Header, ...]:
        """Every block, for the heap's layout."""
        return self.table() + self.back.all()

"""The memory of normal mode's combine, declared once: each expert rank's output rows, in the order it
received them, and a header with the boundaries of each home's block.

Every form of the combine reads its places from here: the torch statement
(`ubep.protocols.combine.torch_halves`) through the `Header` and `Region` names, the
numba and Triton halves through the block indices and header words below (the
combine's own address table: `BackBlocks.table()`, in `TABLE` order).

Legend: see `ubep.layout`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ubep.protocols.base import CODE_RANGE, Sizing
from ubep.transport.base import Field, Header, Region

TABLE = ("back", "y", "y_weights")  # the combine's address table, in this order
BACK, Y, Y_WEIGHTS = range(len(TABLE))
# Back header words: the stamp, then dtype, topk, prefix[R + 1], dispatch (at B_PREFIX + R + 1).
BACK_FIELDS = ("dtype", "topk", "prefix", "dispatch")
B_DTYPE, B_TOPK, B_PREFIX = 1, 2, 3


@dataclass(frozen=True, slots=True)
class BackBlocks:
    """Combine memory: each expert rank's output rows, in the order it received them, and a header
    with the boundaries of each home's block (`prefix`, its recv_prefix_R1)."""

    back: Header
    y: Region  # uint8 [R * T, row bytes]
    y_weights: Region  # float32 [R * T, max_topk]

    @classmethod
    def of(cls, prefix: str, s: Sizing, double: bool) -> BackBlocks:
        R, T, K = s.num_ranks, s.capacity, s.max_topk
        fields = (
            Field("dtype", lo=CODE_RANGE[0], hi=CODE_RANGE[1]),
            Field("topk", hi=K),
            Field("prefix", length=R + 1, hi=R * T),
            Field("dispatch"),  # the seq of the dispatch whose handle this combine uses
        )
        return cls(
            Header(f"{prefix}.back", fields, double=double),
            Region(f"{prefix}.y", (R * T, s.row_bytes), torch.uint8, double=double),
            Region(f"{prefix}.y_weights", (R * T, K), torch.float32, double=double),
        )

    def all(self) -> tuple[Region | Header, ...]:
        return self.table()

    def table(self) -> tuple[Region | Header, ...]:
        """The blocks of the combine's address table, in `TABLE` order."""
        return tuple(getattr(self, name) for name in TABLE)

"""The memory the BSP baseline declares, once (single-buffered: barriers separate the calls).

Every form of the baseline reads its places from here: the torch statement
(`ubep.protocols.bsp.exchange`) through the `Header` and `Region` names, the
numba and Triton phases through the block indices and header words below (their
address table is `BspBlocks.table()`, in `TABLE` order; the combine's blocks have
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

# The dispatch phases' address table, in this order; `barrier` is the Triton phases' barrier word.
TABLE = (
    "counts",
    "staged",
    "stage_x",
    "stage_scales",
    "stage_tokens",
    "stage_topk",
    "stage_weights",
    "barrier",
)
COUNTS, STAGED, STAGE_X, STAGE_SCALES, STAGE_TOKENS, STAGE_TOPK, STAGE_WEIGHTS, BARRIER = range(len(TABLE))
# Header words: counts' record is the stamp, then counts[R]; staged's (one row per writer) the stamp,
# then dtype and topk.
C_COUNTS = 1
STAGED_FIELDS = ("dtype", "topk")
S_DTYPE, S_TOPK = range(1, 1 + len(STAGED_FIELDS))


@dataclass(frozen=True, slots=True)
class BspBlocks:
    """The memory the baseline declares (single-buffered: barriers separate the calls)."""

    counts: Header  # own: tokens for each destination
    staged: Header  # inbox: "your slot from me is written"
    stage_x: Region  # uint8 [R, T, row bytes]: a staging slot per source (FP8: values)
    stage_scales: Region  # float32 [R, T, H // 128]: FP8 scales
    stage_tokens: Region  # int64 [R, T]
    stage_topk: Region  # int64 [R, T, max_topk]: local ids as this rank sees them
    stage_weights: Region  # float32 [R, T, max_topk]
    barrier: Region  # int64 [1]: the device phases' barrier word (the host's lives in its control block)
    back: BackBlocks

    @classmethod
    def of(cls, s: Sizing) -> BspBlocks:
        R, T, K = s.num_ranks, s.capacity, s.max_topk
        return cls(
            counts=Header(
                "bsp.counts",
                (Field("counts", length=R, hi=T, says="announced {value} tokens, capacity is {hi}"),),
                double=False,
                phase="dispatch",
            ),
            staged=Header(
                "bsp.staged",
                (Field("dtype", lo=CODE_RANGE[0], hi=CODE_RANGE[1]), Field("topk", hi=K)),
                inbox=True,
                double=False,
            ),
            stage_x=Region("bsp.stage_x", (R, T, s.row_bytes), torch.uint8),
            stage_scales=Region("bsp.stage_scales", (R, T, s.hidden // fp8.BLOCK), torch.float32),
            stage_tokens=Region("bsp.stage_tokens", (R, T), torch.int64),
            stage_topk=Region("bsp.stage_topk", (R, T, K), torch.int64),
            stage_weights=Region("bsp.stage_weights", (R, T, K), torch.float32),
            barrier=Region("bsp.barrier", (1,), torch.int64),
            back=BackBlocks.of("bsp", s, double=False),
        )

    def table(self) -> tuple[Region | Header, ...]:
        """The blocks of the dispatch phases' address table, in `TABLE` order."""
        return tuple(getattr(self, name) for name in TABLE)

    def all(self) -> tuple[Region | Header, ...]:
        """Every block, for the heap's layout."""
        return self.table() + self.back.all()

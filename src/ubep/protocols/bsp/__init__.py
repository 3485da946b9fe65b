"""The BSP baseline (normal mode): the same work as UBEP, in phases separated by global barriers, as
vendor EP libraries and Megatron structure it.

Its memory (`blocks`): per rank, a `counts` record (tokens for each destination), a
`staged` inbox (a row per source: "your slot from me is written"), a staging slot per
source for rows, FP8 scales, token indices, local top-k and weights, and the Triton
phases' barrier word; the combine's blocks are normal mode's (`ubep.protocols.combine`).

A call runs these phases, in this order:

    dispatch  counts   publish this rank's count for every destination
              barrier
              send     push each destination's rows into its staging slot here; stamp `staged`
              barrier
              verify   every live source's flag, format and count; the prefix sums
              barrier
              reorder  the staging slots into recv_x
    combine   barrier, send back, barrier, reduce                          (normal mode's)

Each phase has three forms that keep the same memory word for word: the torch
statement (`exchange`, readable, the test oracle), the numba phases
(`numba_halves`, entered by `numba_driver`) and the Triton phases (`triton_halves`,
launched by `triton_driver`). `codes` are the status codes the compiled phases
return, `status` turns them into the statement's exceptions.
"""

from ubep.protocols.bsp.blocks import BspBlocks
from ubep.protocols.bsp.exchange import BspExchange

__all__ = ["BspBlocks", "BspExchange"]

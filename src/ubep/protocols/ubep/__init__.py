"""The UBEP protocol (normal mode): no global barrier, data as flag, every byte moved once.

Its memory (`blocks`): per rank, a `route` header (token count, dtype, top-k, and the
count for every destination), a `data` stamp, its own top-k, weights, per-destination
token lists, rows and FP8 scales; the combine's blocks are normal mode's
(`ubep.protocols.combine`).

A call runs these halves, in this order:

    dispatch  send    routing, lists, own rows into own memory; stamp ROUTE, then DATA
              routes  wait for every live source's ROUTE, check it, take its count for this rank
              gather  the local top-k of the listed rows; each source's rows as its DATA lands
    combine   send    own output rows and weights into own memory; stamp BACK     (normal mode's)
              reduce  wait for every live BACK, check, sum each token's rows in rank order

Each half has three forms that keep the same memory word for word: the torch
statement (`exchange`, readable, the test oracle), the numba halves
(`numba_halves`, entered by `numba_driver`) and the Triton halves (`triton_halves`,
launched by `triton_driver`). `codes` are the status codes the compiled halves
return, `status` turns them into the statement's exceptions.
"""

from ubep.protocols.ubep.blocks import UbepBlocks
from ubep.protocols.ubep.exchange import UbepExchange

__all__ = ["UbepBlocks", "UbepExchange"]

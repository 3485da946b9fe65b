"""Low-latency mode (DeepEP's): fixed shapes, one row per (token, expert), puts into per-peer slots,
data as flag, send and receive halves a caller can split (hooks).

Its memory (`blocks`): per rank, double-buffered slots for every (local expert,
source) with each row's (token, top-k slot), a `sent` inbox (per source: dtype, T,
row width, counts per local expert), back slots for returned rows with a `returned`
inbox (per expert rank: dtype, row count), and this rank's reuse and rejection words.

A call runs these halves, in this order:

    dispatch  send     wait until each peer consumed call e - 2; stage this rank's rows once in
                       its own slots; put each destination's slot infos; stamp its `sent` row there
              receive  per source ascending: wait for its `sent` stamp, copy the rows its infos
                       name from its staged rows; mark consumed
    combine   send     put each returned row into the home's back slots; stamp `returned` there
              receive  wait for every expected `returned`, reduce each token's rows, weighted

Each half has three forms that keep the same memory word for word: the torch
statement (`exchange`, readable, the test oracle), the numba halves
(`numba_halves`, entered by `numba_driver`) and the Triton halves (`triton_halves`,
launched by `triton_driver`), but for one place: the Triton halves put a dispatch's
rows into the receivers' slots, pair by pair, where the CPU forms stage them once in
the sender's own (the handshake's `ll_rows` keeps the two out of one group).
`plans` holds what every form shares (send plans, output tensors, row placement),
`local` the one-rank form; `codes` are the status codes the compiled halves return,
`status` turns them into the statement's exceptions.
"""

from ubep.protocols.ll.blocks import LLBlocks
from ubep.protocols.ll.exchange import LLExchange

__all__ = ["LLBlocks", "LLExchange"]

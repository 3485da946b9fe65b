"""This rank's routing, read on the device: topk_idx's values checked, and which of its tokens go to
which rank. The send kernels that take the routing as topk_idx alone use them, so that the host reads
no value of it (docs/device.md, "No host read").

    protocol halves (each protocol's triton_halves) -> [these] -> topk_idx in device memory

The rules are `ubep.validate.topk_idx`'s: every value in [-1, E), no expert twice in a row.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def first_bad_topk(topk, N, K, E, NB: tl.constexpr, KB: tl.constexpr):
    """Where topk int64 [N, K] breaks the rules: (the first value outside [-1, E) in row-major order,
    as its flat index token * KB + k, or N * KB if none; that value; the first row that lists an
    expert twice, or N if none; that expert). One pass, each block of rows loaded once."""
    ks = tl.arange(0, KB)
    beyond = N * KB  # above every flat index
    bad_at = beyond
    bad_value = tl.full((), 0, tl.int64)
    twice_row = N
    twice_expert = tl.full((), -1, tl.int64)
    t0 = 0
    while t0 < N:
        tokens = t0 + tl.arange(0, NB)
        inside = (tokens[:, None] < N) & (ks[None, :] < K)
        chosen = tl.load(topk + tokens[:, None] * K + ks[None, :], mask=inside, other=-1)
        flat = tokens[:, None] * KB + ks[None, :]
        first = tl.min(
            tl.min(tl.where(inside & ((chosen < -1) | (chosen >= E)), flat, beyond), axis=1), axis=0
        )
        if first < bad_at:
            bad_at = first
            bad_value = tl.sum(tl.sum(tl.where(flat == first, chosen, 0), axis=1), axis=0)
        earlier = ks[None, :, None] < ks[None, None, :]  # each pair (k, k') of a row once
        same = (chosen[:, :, None] == chosen[:, None, :]) & (chosen[:, :, None] >= 0) & earlier
        repeated = tl.max(tl.max(tl.where(same, chosen[:, :, None], -1), axis=2), axis=1)  # [NB]: -1 or one
        row = tl.min(tl.where(repeated >= 0, tokens, N), axis=0)
        if row < twice_row:
            twice_row = row
            twice_expert = tl.sum(tl.where(tokens == row, repeated, 0), axis=0)
        t0 += NB
    return bad_at, bad_value, twice_row, twice_expert


@triton.jit
def rank_hits(topk, owner, tokens, N, K, E, rank, KB: tl.constexpr):
    """int64 [NB]: 1 where token tokens[i] selects an expert of `rank` (owner int64 [E]: each expert's
    rank), else 0. Ids outside [0, E) select none and are never used as an index."""
    ks = tl.arange(0, KB)
    inside = (tokens[:, None] < N) & (ks[None, :] < K)
    chosen = tl.load(topk + tokens[:, None] * K + ks[None, :], mask=inside, other=-1)
    valid = inside & (chosen >= 0) & (chosen < E)
    who = tl.load(owner + tl.where(valid, chosen, 0), mask=valid, other=-1)
    return tl.max((who == rank).to(tl.int64), axis=1)

"""The BSP baseline's phases, each one compiled function over the Buffer's address table.

    protocol (bsp: phases and barriers) -> [these phases] -> memory (address table)

The baseline keeps its barriers, its count round and its staging copy (see
`ubep.protocols.bsp.exchange`, the statement in torch, whose memory layout these keep word
for word); compiled, what is left between it and UBEP is the protocol's
difference, not Python's. Its combine is normal mode's (`ubep.protocols.combine`),
between barriers.

The table (int64 [R, 8, 2]) holds every block of `BspBlocks.table()` in every
rank's memory; bsp's blocks are single-buffered, so both halves name the same
address. A barrier is a compiled wait like the others: raise this rank's word
to the call's target, then wait until every live peer's word reaches it and no
peer's abort notice names the call (Python's sleeper then reports the abort).

Example (R = 2, rank 0 routes token 1 to rank 1): bsp_send writes token 1's row
into rank 1's staging slot 0 (row 0), its index 1 into stage_tokens[0, 0] and its
local top-k, then stamps rank 1's `staged` inbox row 0; after the barriers, rank 1's
bsp_reorder copies slot 0's rows into recv_x [0, 1).

Legend: see `ubep.layout`.
"""

from __future__ import annotations

import numpy as np

from ubep.engine.numba_kernels import _elements_at, _jit, _move, words_once
from ubep.engine.numba_sync import (
    back_off,
    load_acquire,
    masked_by,
    store_relaxed,
    store_release,
    wake_if_asleep,
    wake_sleepers,
)
from ubep.protocols.bsp.blocks import (
    C_COUNTS,
    COUNTS,
    S_DTYPE,
    S_TOPK,
    STAGE_SCALES,
    STAGE_TOKENS,
    STAGE_TOPK,
    STAGE_WEIGHTS,
    STAGE_X,
    STAGED,
    STAGED_FIELDS,
)
from ubep.protocols.bsp.codes import DONE, E_FIELD, E_FORMAT, E_LOCAL, E_MISSING, E_TOKENS, WAITING

NOTICE_SEQ_SHIFT = 24  # an abort notice's seq sits above this bit (`ubep.transport.heap.pack_notice`)
MASKED = -1  # the send found, after a destination, that the peers masked this rank

_I64, _F32 = np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float32)
STAGED_WORDS = 1 + len(STAGED_FIELDS)  # a writer's row of the `staged` inbox: stamp, dtype, topk


@_jit
def _fail(status, code, peer, a, b, c):
    status[0], status[1], status[2], status[3], status[4] = code, peer, a, b, c
    return code


@_jit
def _behind(barrier, notice, live, me, target, seq, pending):
    """Live peers whose barrier word is below `target`, or that aborted call `seq`, into pending."""
    n = 0
    for p in live:
        aborted = load_acquire(notice[p]) >> NOTICE_SEQ_SHIFT == seq
        if p != me and (load_acquire(barrier[p]) < target or aborted):
            pending[n] = p
            n += 1
    return n


@_jit
def bsp_barrier(barrier, notice, asleep, me, live, target, seq, wake, pending, spins, yields, status):
    """Every live rank arrives before any leaves: raise this rank's word to `target` (once), ring the
    sleepers, wait for the others. status[5]: peers to ring."""
    if load_acquire(barrier[me]) < target:
        store_release(barrier[me], target)
        status[5] += wake_sleepers(asleep, live, me, wake)
    store_relaxed(asleep[me], 0)
    step = 0
    n = _behind(barrier, notice, live, me, target, seq, pending)
    while n and back_off(step, spins, yields, asleep, me):
        n = _behind(barrier, notice, live, me, target, seq, pending)
        step += 1
    if n:
        status[1] = n
        return WAITING
    store_relaxed(asleep[me], 0)
    return DONE


@_jit
def bsp_counts(table, me, epoch, counts):
    """Publish this rank's row count for every destination (the count round's message)."""
    R = counts.size
    words = _elements_at(_I64, table[me, COUNTS, 0], C_COUNTS + R)
    for r in range(R):
        words[C_COUNTS + r] = counts[r]
    store_release(table[me, COUNTS, 0], epoch)


@_jit
def bsp_send(
    table, asleep, me, epoch, live, x_rows, scales, topk, weights, in_rank, local_of_RE, dtype_code, Kmax, T,
    row_bytes, wake, members, generation,
):  # fmt: skip
    """Push each destination's rows into its staging slot for this rank (own first, then the next
    ranks), with their token indices and local top-k as the destination sees them, then stamp its
    `staged` inbox row; after each destination, the membership check (`masked_by`). topk [N, K]
    (K = 0: cached dispatch); returns peers to ring, or MASKED."""
    N, b = x_rows.shape
    K, S, R = topk.shape[1], scales.shape[1], in_rank.shape[1]
    woken = 0
    for j in range(R):
        dst = (me + j) % R
        here = False
        for p in live:
            here |= p == dst
        if not here:
            continue
        slot_x = table[dst, STAGE_X, 0] + me * T * row_bytes
        tokens = _elements_at(_I64, table[dst, STAGE_TOKENS, 0] + me * T * 8, T)
        n = 0
        for t in range(N):
            if not in_rank[t, dst]:
                continue
            _move(slot_x + n * b, x_rows.ctypes.data + t * b, b)
            tokens[n] = t
            if S:
                slot_scales = table[dst, STAGE_SCALES, 0] + (me * T + n) * S * 4
                _move(slot_scales, scales.ctypes.data + t * S * 4, S * 4)
            if K:
                idx = _elements_at(_I64, table[dst, STAGE_TOPK, 0] + (me * T + n) * Kmax * 8, K)
                w = _elements_at(_F32, table[dst, STAGE_WEIGHTS, 0] + (me * T + n) * Kmax * 4, K)
                for k in range(K):
                    e = topk[t, k]
                    local = local_of_RE[dst, e] if e >= 0 else -1
                    idx[k] = local
                    w[k] = weights[t, k] if local >= 0 else np.float32(0.0)
            n += 1
        record = _elements_at(_I64, table[dst, STAGED, 0] + me * STAGED_WORDS * 8, STAGED_WORDS)
        record[S_DTYPE], record[S_TOPK] = dtype_code, K
        store_release(table[dst, STAGED, 0] + me * STAGED_WORDS * 8, epoch)  # the slot above is visible
        if dst != me:
            woken += wake_if_asleep(asleep, dst, wake)
        if masked_by(members, live, me, generation) >= 0:
            return MASKED
    return woken


@_jit
def bsp_verify(table, me, epoch, live, dtype_code, K, Kmax, T, dtype_lo, dtype_hi, counts, pending, status):
    """After the token barrier: every live source's staging flag, its format, and its count for this rank."""
    R = counts.size
    n = 0
    for p in live:
        if load_acquire(table[me, STAGED, 0] + p * STAGED_WORDS * 8) != epoch:
            pending[n] = p
            n += 1
    if n:
        status[1] = n
        return E_MISSING
    for r in range(R):
        counts[r] = 0
    for p in live:
        record = words_once(table[me, STAGED, 0] + p * STAGED_WORDS * 8, STAGED_WORDS)  # checked: this copy
        if not dtype_lo <= record[S_DTYPE] <= dtype_hi:
            return _fail(status, E_FIELD, p, record[S_DTYPE], 0, 0)
        if not 0 <= record[S_TOPK] <= Kmax:
            return _fail(status, E_FIELD, p, record[S_TOPK], 1, 0)
        if record[S_DTYPE] != dtype_code or record[S_TOPK] != K:
            return _fail(status, E_FORMAT, p, record[S_DTYPE], record[S_TOPK], 0)
        theirs = words_once(table[p, COUNTS, 0], C_COUNTS + R)  # checked and used: this copy
        for r in range(R):
            if not 0 <= theirs[C_COUNTS + r] <= T:
                return _fail(status, E_FIELD, p, theirs[C_COUNTS + r], 0, 1)
        counts[p] = theirs[C_COUNTS + me]
    return DONE


@_jit
def bsp_reorder(
    table, me, prefix, T, Kmax, L, row_bytes, recv_x, recv_scales, recv_idx, recv_w, src_token, status
):
    """After the last barrier: every source's staging slot into its final place (the reorder copy)."""
    R = prefix.size - 1
    b, S, K = recv_x.shape[1], recv_scales.shape[1], recv_idx.shape[1]
    for src in range(R):
        a, n = prefix[src], prefix[src + 1] - prefix[src]
        if n == 0:
            continue
        _move(recv_x.ctypes.data + a * b, table[me, STAGE_X, 0] + src * T * row_bytes, n * b)
        _move(src_token.ctypes.data + a * 8, table[me, STAGE_TOKENS, 0] + src * T * 8, n * 8)
        for i in range(a, a + n):  # the copy, checked: the staging slot is src's to write
            if src_token[i] < 0 or src_token[i] >= T:
                return _fail(status, E_TOKENS, src, T, 0, 0)
        if S:
            staged = table[me, STAGE_SCALES, 0] + src * T * S * 4
            _move(recv_scales.ctypes.data + a * S * 4, staged, n * S * 4)
        for i in range(n):
            idx = _elements_at(_I64, table[me, STAGE_TOPK, 0] + (src * T + i) * Kmax * 8, K)
            w = _elements_at(_F32, table[me, STAGE_WEIGHTS, 0] + (src * T + i) * Kmax * 4, K)
            for k in range(K):
                local = idx[k]
                if local < -1 or local >= L:
                    return _fail(status, E_LOCAL, src, L, 0, 0)
                recv_idx[a + i, k] = local
                recv_w[a + i, k] = w[k]
    return DONE

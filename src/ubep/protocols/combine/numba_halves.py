"""Normal mode's shared call halves, compiled (numba): the combine that ubep and bsp both run, and the
waiting and status helpers of every normal-mode half.

    protocol (ubep, bsp) -> [combine_send, combine_reduce] -> memory (the combine's address table)

The statement in torch is `ubep.protocols.combine.torch_halves`; these halves keep its
memory layout word for word (`ubep.protocols.combine.blocks`). The table
(int64 [R, 3, 2]) holds the address of every block of `BackBlocks.table()` in
every rank's memory, for both halves of the double buffer; `asleep` (int64 [R])
the address of each rank's ASLEEP word.

Waiting. A half that finds a source missing spins `spins` polls (with the
spin-wait hint), then yields the core `yields` times, then raises its rank's
ASLEEP word, fences, and looks once more: still missing, it returns WAITING with
the pending ranks, and Python sleeps on the doorbell (under the deadline, with
the dead-peer and abort checks) and enters again. A publisher fences after each
stamp and reports the peers whose ASLEEP word is up (`wake`), which Python rings.
The two fences make a Dekker pair: either the sleeper sees the stamp, or the
publisher sees the sleeper's word and rings it, so no wake-up is lost.

Example (R = 2, home 0, rank 1 returns rows [a, b] of home 0's block): combine_send
on rank 1 writes its rows and stamps BACK with prefix [0, 2, ...]; combine_reduce on
rank 0 waits for both stamps, then sums token t's rows over ranks 0 and 1 in float32.

Legend: see `ubep.layout`.
"""

from __future__ import annotations

import numpy as np

from ubep.engine.numba_kernels import CHUNK, _elements_at, _jit, _move, store, widen, words_once
from ubep.engine.numba_sync import (
    back_off,
    load_acquire,
    store_relaxed,
    store_release,
    wake_sleepers,
)
from ubep.protocols.combine.blocks import B_DTYPE, B_PREFIX, B_TOPK, BACK, Y_WEIGHTS, Y
from ubep.protocols.combine.codes import DONE, E_FIELD, E_OTHER_CALL, E_ROWS, WAITING

_I64, _F32 = np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float32)  # element types for raw views


@_jit
def publish(address, epoch, asleep, live, me, wake):
    """Stamp a header (release), then find the sleepers to ring."""
    store_release(address, epoch)
    return wake_sleepers(asleep, live, me, wake)


@_jit
def _pending(table, block, half, live, epoch, done, pending):
    """Live ranks whose `block` stamp for `epoch` has not landed (and not done already), into pending."""
    n = 0
    for p in live:
        if done[p] == 0 and load_acquire(table[p, block, half]) != epoch:
            pending[n] = p
            n += 1
    return n


@_jit
def await_stamps(table, asleep, block, half, live, me, epoch, done, pending, spins, yields, final):
    """Poll until one pending rank landed or the budget ran out; returns how many are still pending.

    `final`: all must land (return only at 0); otherwise return as soon as any rank not done yet
    has landed (at once if one already has).
    Leaves this rank's ASLEEP word up when it returns with pending ranks.
    """
    store_relaxed(asleep[me], 0)  # awake: publishers need not ring
    todo = 0  # ranks not done yet: with `final` unset, one of them landed is work to do at once
    for p in live:
        todo += done[p] == 0
    n = _pending(table, block, half, live, epoch, done, pending)
    step = 0
    while n and (final or n == todo) and back_off(step, spins, yields, asleep, me):
        n = _pending(table, block, half, live, epoch, done, pending)
        step += 1
    if n == 0 or (not final and n < todo):
        store_relaxed(asleep[me], 0)
    return n


@_jit
def fail(status, code, peer, a, b, c, d):
    """End a half with an error: the code, then (peer, what it sent, ..., expected) in status[1:6]."""
    status[0], status[1], status[2], status[3], status[4], status[5] = code, peer, a, b, c, d
    return code


# -- combine ----------------------------------------------------------------------------------------


@_jit
def combine_send(
    table, asleep, me, epoch, half, live, y_rows, weights, Kmax, prefix, dispatch_seq, dtype_code, wake
):
    """An expert rank's half of combine: its output rows (y_rows uint8 [M, b]) and weights
    (float32 [M, K], K may be 0) into its own memory once, then the back header, stamped."""
    M, b = y_rows.shape
    K, R = weights.shape[1], prefix.size - 1
    own = table[me]
    if M:
        _move(own[Y, half], y_rows.ctypes.data, M * b)
    for i in range(M):
        w = _elements_at(_F32, own[Y_WEIGHTS, half] + i * Kmax * 4, K)
        for k in range(K):
            w[k] = weights[i, k]
    words = _elements_at(_I64, own[BACK, half], B_PREFIX + R + 2)
    words[B_DTYPE], words[B_TOPK] = dtype_code, K
    for r in range(R + 1):
        words[B_PREFIX + r] = prefix[r]
    words[B_PREFIX + R + 1] = dispatch_seq
    return publish(own[BACK, half], epoch, asleep, live, me, wake)


@_jit
def combine_reduce(
    table, asleep, me, epoch, half, live, in_rank, send_counts, dispatch_seq, dtype_code, dtype_lo, dtype_hi,
    Kmax, rows_max, out, out_w, done, pending, spins, yields, status,
):  # fmt: skip
    """The home's half of combine: once every live expert rank's back header landed, check them all,
    then sum each token's rows over ranks ascending (the reference's order) in float32, rounding once.

    in_rank uint8 [N, R] and send_counts int64 [R] come from the dispatch's handle;
    out [N, H] float32, or bf16 as uint16 bits; out_w float32 [N, K] (K = 0: no weights).
    """
    N, H = out.shape
    K, R = out_w.shape[1], send_counts.size
    n = await_stamps(table, asleep, BACK, half, live, me, epoch, done, pending, spins, yields, True)
    if n:
        status[1] = n
        return WAITING
    back_RW = np.zeros((R, B_PREFIX + R + 2), dtype=np.int64)  # each live peer's header, copied once
    for p in live:
        back_RW[p] = words_once(table[p, BACK, half], B_PREFIX + R + 2)
    for p in live:  # bounds, field by field
        words = back_RW[p]
        if not dtype_lo <= words[B_DTYPE] <= dtype_hi:
            return fail(status, E_FIELD, p, words[B_DTYPE], 0, 0, 0)
        if not 0 <= words[B_TOPK] <= Kmax:
            return fail(status, E_FIELD, p, words[B_TOPK], 1, 0, 0)
        for r in range(R + 1):
            if not 0 <= words[B_PREFIX + r] <= rows_max:
                return fail(status, E_FIELD, p, words[B_PREFIX + r], 2, 0, 0)
    for p in live:
        theirs = back_RW[p, B_PREFIX + R + 1]
        if theirs != dispatch_seq:
            return fail(status, E_OTHER_CALL, p, theirs, 0, 0, 0)
    begin = np.zeros(R, dtype=np.int64)
    for p in live:
        words = back_RW[p]
        begin[p] = words[B_PREFIX + me]
        rows = words[B_PREFIX + me + 1] - begin[p]
        if rows != send_counts[p] or words[B_DTYPE] != dtype_code or words[B_TOPK] != K:
            return fail(status, E_ROWS, p, rows, words[B_DTYPE], words[B_TOPK], send_counts[p])
    b = H * out.itemsize
    acc = np.empty(CHUNK, dtype=np.float32)
    acc_w = np.empty(max(K, 1), dtype=np.float32)
    at = begin.copy()  # each expert rank's next row for this rank
    for t in range(N):
        for c in range(0, H, CHUNK):  # a chunk of the row at a time: its sum stays in L1, and vectorises
            width = min(CHUNK, H - c)
            acc[:width] = np.float32(0.0)
            for r in range(R):
                if in_rank[t, r]:
                    row = _elements_at(out[0, :0], table[r, Y, half] + at[r] * b + c * out.itemsize, width)
                    for j in range(width):
                        acc[j] += widen(row[j])
            out_row = out[t, c : c + width]
            for j in range(width):
                store(out_row, j, acc[j])
        acc_w[:] = np.float32(0.0)
        for r in range(R):
            if not in_rank[t, r]:
                continue
            if K:
                w = _elements_at(_F32, table[r, Y_WEIGHTS, half] + at[r] * Kmax * 4, K)
                for k in range(K):
                    acc_w[k] += w[k]
            at[r] += 1
        for k in range(K):
            out_w[t, k] = acc_w[k]
    return DONE

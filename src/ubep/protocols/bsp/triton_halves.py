"""The BSP baseline's dispatch phases and barriers as Triton kernels: each phase one launch over the
Buffer's address table.

    protocol (bsp: phases and barriers) -> [these kernels] -> memory (address table)

The same phases as `ubep.protocols.bsp.numba_halves` (numba), over the same memory, word
for word: the table (int64 [R, 11, 2]) holds every block of `BspBlocks.all()`
in every rank's memory (single-buffered: both halves name the same address);
counts: stamp, counts[R]; the `staged` inbox: per source, stamp, dtype, top-k;
a staging slot per source (rows packed at their own width, top-k and weights at
stride max_topk, local ids as the destination sees them). Its combine is normal
mode's (`ubep.protocols.combine.triton_halves`). The barrier word is the last block
(`BspBlocks.barrier`), in device memory, since the host's control block is out of
a GPU's reach.

    counts   (1 program): own counts record (and the layout from top-k, checked), stamped
    barrier  (1 program): raise own word to the target, wait (bounded) for every live peer's
    send     ((destination, token block) programs): push rows, tokens, local top-k into the
             destination's slot; the last of its programs stamps its `staged` inbox row
    verify   (1 program): every live source's flag, format and counts; the prefix
    reorder  ((source, row block) programs): the staging slots into recv_x, checked

Ordering and status words are those of `ubep.protocols.ubep.triton_halves` and
`combine.triton_halves` (docs/device.md): plain stores, a block barrier, a
system-scope release; system-scope acquires; polls bounded by `max_spins`,
status[6] naming a peer a wait ran out on.

Legend: see `ubep.layout`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ubep.engine.triton_route import rank_hits
from ubep.engine.triton_sync import int64_ptr, load_acquire, load_epoch, store_release
from ubep.protocols.bsp import blocks, codes
from ubep.protocols.combine.triton_halves import copy_words, fail, own_topk_ok

# The places of `ubep.protocols.bsp.blocks` and the codes of `ubep.protocols.bsp.codes`, as Triton
# constants.
BLOCKS: tl.constexpr = tl.constexpr(len(blocks.TABLE))
COUNTS: tl.constexpr = tl.constexpr(blocks.COUNTS)
STAGED: tl.constexpr = tl.constexpr(blocks.STAGED)
STAGE_X: tl.constexpr = tl.constexpr(blocks.STAGE_X)
STAGE_SCALES: tl.constexpr = tl.constexpr(blocks.STAGE_SCALES)
STAGE_TOKENS: tl.constexpr = tl.constexpr(blocks.STAGE_TOKENS)
STAGE_TOPK: tl.constexpr = tl.constexpr(blocks.STAGE_TOPK)
STAGE_WEIGHTS: tl.constexpr = tl.constexpr(blocks.STAGE_WEIGHTS)
BARRIER: tl.constexpr = tl.constexpr(blocks.BARRIER)
C_COUNTS: tl.constexpr = tl.constexpr(blocks.C_COUNTS)  # counts record: stamp, counts[R]
S_DTYPE: tl.constexpr = tl.constexpr(blocks.S_DTYPE)  # staged inbox row: stamp, dtype, topk
S_TOPK: tl.constexpr = tl.constexpr(blocks.S_TOPK)
S_WORDS: tl.constexpr = tl.constexpr(1 + len(blocks.STAGED_FIELDS))
E_FIELD: tl.constexpr = tl.constexpr(codes.E_FIELD)
E_MISSING: tl.constexpr = tl.constexpr(codes.E_MISSING)
E_FORMAT: tl.constexpr = tl.constexpr(codes.E_FORMAT)
E_TOKENS: tl.constexpr = tl.constexpr(codes.E_TOKENS)
E_LOCAL: tl.constexpr = tl.constexpr(codes.E_LOCAL)
E_WORST: tl.constexpr = tl.constexpr(codes.E_WORST)
E_REJECTED: tl.constexpr = tl.constexpr(codes.E_REJECTED)
E_OWN_EXPERT: tl.constexpr = tl.constexpr(codes.E_OWN_EXPERT)
E_OWN_REPEATED: tl.constexpr = tl.constexpr(codes.E_OWN_REPEATED)
REJECTED: tl.constexpr = tl.constexpr(codes.REJECTED)


@triton.jit
def _stopped(status):
    """Whether an earlier phase of this call failed or ran out of polls (then the later ones do nothing)."""
    return (tl.load(status) != 0) | (tl.load(status + 6) != 0)


@triton.jit
def _address(table, rank, block):
    """Address (int64) of `block` in `rank`'s memory (single-buffered: half 0)."""
    return tl.load(table + (rank * BLOCKS + block) * 2)


@triton.jit
def bsp_counts_kernel(
    table, me, epochs, counts, R, topk, N, K, in_rank, owner, E, forced, status,
    NB: tl.constexpr, KB: tl.constexpr, RB: tl.constexpr, ROUTED: tl.constexpr,
):  # fmt: skip
    """Publish this rank's row count for every destination (counts int64 [R]): the count round.

    ROUTED: the routing is topk (int64 [N, K]) alone, and in_rank (uint8 [N, R]) and counts are
    outputs: topk's values are checked first (`triton_route.first_bad_topk`; a bad one fails the call
    with E_OWN_EXPERT or E_OWN_REPEATED in status, and the record says REJECTED, so that the peers
    stop), then every column of in_rank and its count are derived from topk and owner (int64 [E],
    each expert's rank). Otherwise counts is an input. forced >= 0 publishes that count instead (a
    fault plan's corrupt count)."""
    epoch, _ = load_epoch(epochs)
    rs = tl.arange(0, RB)
    record = int64_ptr(_address(table, me, COUNTS))
    go = tl.full((), 1, tl.int32)
    if ROUTED:
        go = own_topk_ok(topk, N, K, E, status, me, NB, KB)
    if go == 0:
        tl.store(record + C_COUNTS + rs, tl.full((RB,), REJECTED, tl.int64), mask=rs < R)
    else:
        if ROUTED:
            values = tl.zeros((RB,), tl.int64)
            p = tl.full((), 0, tl.int32)
            while p < R:
                at = tl.full((), 0, tl.int64)
                t0 = 0
                while t0 < N:
                    tokens = t0 + tl.arange(0, NB)
                    hit = rank_hits(topk, owner, tokens, N, K, E, p, KB)
                    tl.store(in_rank + tokens * R + p, hit.to(tl.uint8), mask=tokens < N)
                    at += tl.sum(hit, axis=0)
                    t0 += NB
                values = tl.where(rs == p, at, values)
                p += 1
            tl.store(counts + rs, values, mask=rs < R)
        else:
            values = tl.load(counts + rs, mask=rs < R, other=0)
        if forced >= 0:
            values = tl.zeros((RB,), tl.int64) + forced
        tl.store(record + C_COUNTS + rs, values, mask=rs < R)
    tl.debug_barrier()
    store_release(_address(table, me, COUNTS), epoch)


@triton.jit
def bsp_barrier_kernel(table, live, me, targets, R, status, max_spins):
    """Every live rank arrives before any leaves: raise this rank's barrier word to the target (int64
    [1], a device word), then wait (bounded) until every live peer's word reaches it. A rank whose
    call failed does neither, unless it rejected its own input: it then arrives and waits for none."""
    target = tl.load(targets)
    own = _address(table, me, BARRIER)
    go = tl.full((), 1, tl.int32)
    code = tl.load(status)
    if _stopped(status):
        go = tl.full((), 0, tl.int32)
        if (code == E_OWN_EXPERT) | (code == E_OWN_REPEATED):  # it still arrives, so that the peers
            store_release(own, target)  # find its REJECTED record instead of waiting; it waits for none
    else:  # again on a relaunch: the same target
        tl.debug_barrier()
        store_release(own, target)
    p = tl.full((), 0, tl.int32)
    while (go != 0) & (p < R):
        if (tl.load(live + p) != 0) & (p != me):
            word = _address(table, p, BARRIER)
            seen = load_acquire(word)
            spins = tl.full((), 0, tl.int32)
            while (seen < target) & (spins < max_spins):
                seen = load_acquire(word)
                spins += 1
            if seen < target:
                tl.atomic_xchg(status + 6, tl.full((), 1, tl.int64) + p, sem="relaxed", scope="gpu")
                go = tl.full((), 0, tl.int32)
        p += 1


@triton.jit
def bsp_send_kernel(
    table, live, me, epochs, x, W, b, scales, S, topk, weights, N, K, in_rank, R, local_of_RE, E, code,
    Kmax, T, row_bytes, arrivals, blocks, status,
    WORD: tl.constexpr, NB: tl.constexpr, KB: tl.constexpr, WB: tl.constexpr,
):  # fmt: skip
    """Program (dst, i): push token block i's rows for live destination dst into its staging slot for
    this rank (after the rows of earlier blocks: a prefix over in_rank uint8 [N, R]), with their token
    indices and, K > 0, their local top-k as dst sees it (local_of_RE int64 [R, E]; weight 0 where not
    dst's); x [N, W] words of b bytes, scales [N, S] int32 words. The last of dst's programs writes
    the `staged` record (code, K) and stamps it. arrivals int64 [R] start zeroed for the call."""
    epoch, _ = load_epoch(epochs)
    dst = tl.program_id(0)
    i = tl.program_id(1)
    if (tl.load(live + dst) != 0) & (not _stopped(status)):
        before = tl.full((), 0, tl.int64)
        t0 = 0
        while t0 < i * NB:  # rows of earlier blocks for dst
            tokens = t0 + tl.arange(0, NB)
            before += tl.sum(
                tl.load(in_rank + tokens * R + dst, mask=tokens < N, other=0).to(tl.int64), axis=0
            )
            t0 += NB
        tokens = i * NB + tl.arange(0, NB)
        hit = tl.load(in_rank + tokens * R + dst, mask=tokens < N, other=0).to(tl.int64)
        ok = hit != 0
        slot = me * T + before + tl.cumsum(hit, axis=0) - 1  # row of dst's staging, for the hits
        rows = tokens.to(tl.int64)
        stage_x = (_address(table, dst, STAGE_X) + me * T * row_bytes).to(tl.pointer_type(WORD))
        copy_words(x, stage_x, rows, slot - me * T, ok, W, WB)
        stage_s = _address(table, dst, STAGE_SCALES).to(tl.pointer_type(tl.int32))
        copy_words(scales, stage_s, rows, slot, ok, S, WB)
        tl.store(int64_ptr(_address(table, dst, STAGE_TOKENS)) + slot, rows, mask=ok)
        if K > 0:
            ks = tl.arange(0, KB)
            both = ok[:, None] & (ks[None, :] < K)
            e = tl.load(topk + rows[:, None] * K + ks[None, :], mask=both, other=-1)
            w = tl.load(weights + rows[:, None] * K + ks[None, :], mask=both, other=0.0)
            local = tl.load(local_of_RE + dst * E + e, mask=both & (e >= 0), other=-1)
            idx_at = int64_ptr(_address(table, dst, STAGE_TOPK))
            w_at = _address(table, dst, STAGE_WEIGHTS).to(tl.pointer_type(tl.float32))
            tl.store(idx_at + slot[:, None] * Kmax + ks[None, :], local, mask=both)
            tl.store(w_at + slot[:, None] * Kmax + ks[None, :], tl.where(local >= 0, w, 0.0), mask=both)
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals + dst, 1, sem="acq_rel", scope="sys")
        if arrived == blocks - 1:  # the last of dst's programs: every row for dst is ordered before this
            record = int64_ptr(_address(table, dst, STAGED)) + me * S_WORDS
            tl.store(record + S_DTYPE, code)  # stored as int64, the pointer's type
            tl.store(record + S_TOPK, K)
            tl.debug_barrier()
            store_release(_address(table, dst, STAGED) + me * S_WORDS * 8, epoch)


@triton.jit
def bsp_verify_kernel(
    table, live, me, epochs, R, code, K, Kmax, T, dtype_lo, dtype_hi, counts, prefix, worst, pending,
    status, RB: tl.constexpr,
):  # fmt: skip
    """After the token barrier: a live source whose counts record says REJECTED (E_REJECTED); every
    live source's staging flag (missing ones into pending, their number in status[1]), its format,
    and its count for this rank (counts int64 [R]), in the numba `bsp_verify`'s order; then prefix
    int64 [R + 1] (with worst > 0, the total must fit)."""
    epoch, _ = load_epoch(epochs)
    n = tl.full((), 0, tl.int64)
    p = tl.full((), 0, tl.int32)
    if _stopped(status):
        p = R + p
    rejected = tl.full((), -1, tl.int32)  # the first live source whose counts record says REJECTED
    while p < R:
        if (tl.load(live + p) != 0) & (rejected < 0):
            if tl.load(int64_ptr(_address(table, p, COUNTS)) + C_COUNTS + me) == REJECTED:
                rejected = p
        p += 1
    if rejected >= 0:
        fail(status, E_REJECTED, rejected, 0, 0, 0, 0)
    p = tl.full((), 0, tl.int32)
    if _stopped(status):
        p = R + p
    while p < R:
        if tl.load(live + p) != 0:
            if load_acquire(_address(table, me, STAGED) + p * S_WORDS * 8) != epoch:
                tl.store(pending + n, p)
                n += 1
        p += 1
    if n > 0:
        fail(status, E_MISSING, n, 0, 0, 0, 0)
    elif not _stopped(status):
        go = tl.full((), 1, tl.int32)
        rs = tl.arange(0, RB)
        total = tl.full((), 0, tl.int64)
        p = tl.full((), 0, tl.int32)
        while (go != 0) & (p < R):
            count = tl.full((), 0, tl.int64)
            if tl.load(live + p) != 0:
                record = int64_ptr(_address(table, me, STAGED)) + p * S_WORDS
                dtype = tl.load(record + S_DTYPE)
                their_k = tl.load(record + S_TOPK)
                theirs = tl.load(int64_ptr(_address(table, p, COUNTS)) + C_COUNTS + rs, mask=rs < R, other=0)
                bad = (rs < R) & ((theirs < 0) | (theirs > T))
                first_bad = tl.min(tl.where(bad, rs, RB), axis=0)
                bad_count = tl.sum(tl.where(rs == first_bad, theirs, 0), axis=0)
                if (dtype < dtype_lo) | (dtype > dtype_hi):
                    fail(status, E_FIELD, p, dtype, 0, 0, 0)
                    go = tl.full((), 0, tl.int32)
                elif (their_k < 0) | (their_k > Kmax):
                    fail(status, E_FIELD, p, their_k, 1, 0, 0)
                    go = tl.full((), 0, tl.int32)
                elif (dtype != code) | (their_k != K):
                    fail(status, E_FORMAT, p, dtype, their_k, 0, 0)
                    go = tl.full((), 0, tl.int32)
                elif first_bad < RB:
                    fail(status, E_FIELD, p, bad_count, 0, 1, 0)
                    go = tl.full((), 0, tl.int32)
                else:  # the count as loaded above and checked: never loaded again
                    count = tl.sum(tl.where(rs == me, theirs, 0), axis=0)
            tl.store(counts + p, count)
            tl.store(prefix + p, total)
            total += count
            p += 1
        if go != 0:
            tl.store(prefix + R, total)
            if (worst > 0) & (total > worst):
                fail(status, E_WORST, -1, total, worst, 0, 0)


@triton.jit
def bsp_reorder_kernel(
    table, me, prefix, R, T, Kmax, L, row_bytes, recv_x, W, recv_scales, S, recv_idx, recv_w, K,
    src_token, src_rank, status,
    WORD: tl.constexpr, IB: tl.constexpr, KB: tl.constexpr, WB: tl.constexpr,
):  # fmt: skip
    """After the last barrier, program (src, i): rows [i * IB, (i + 1) * IB) of src's staging slot into
    their final place (recv_x [M, W] words, recv_scales [M, S] int32 words, src_token and src_rank
    int64 [M], K > 0:
    recv_idx int64 [M, K] and recv_w float32 [M, K]), then their token indices and local ids checked
    (the numba `bsp_reorder`'s checks, naming the source). Runs only when every phase before it succeeded."""
    src = tl.program_id(0)
    i = tl.program_id(1)
    a = tl.load(prefix + src)
    n = tl.load(prefix + src + 1) - a
    if (i * IB < n) & (not _stopped(status)):
        ii = i * IB + tl.arange(0, IB)
        ok = ii < n
        rows = a + ii
        slot = (src * T + ii).to(tl.int64)
        stage_x = (_address(table, me, STAGE_X) + src * T * row_bytes).to(tl.pointer_type(WORD))
        copy_words(stage_x, recv_x, ii.to(tl.int64), rows, ok, W, WB)
        stage_s = _address(table, me, STAGE_SCALES).to(tl.pointer_type(tl.int32))
        copy_words(stage_s, recv_scales, slot, rows, ok, S, WB)
        tokens = tl.load(int64_ptr(_address(table, me, STAGE_TOKENS)) + slot, mask=ok, other=0)
        tl.store(src_token + rows, tokens, mask=ok)
        tl.store(src_rank + rows, tl.zeros((IB,), tl.int64) + src, mask=ok)
        bad_local = tl.full((), 0, tl.int32)
        if K > 0:
            ks = tl.arange(0, KB)
            both = ok[:, None] & (ks[None, :] < K)
            idx = tl.load(
                int64_ptr(_address(table, me, STAGE_TOPK)) + slot[:, None] * Kmax + ks[None, :], mask=both
            )
            w_at = _address(table, me, STAGE_WEIGHTS).to(tl.pointer_type(tl.float32))
            w = tl.load(w_at + slot[:, None] * Kmax + ks[None, :], mask=both)
            tl.store(recv_idx + rows[:, None] * K + ks[None, :], idx, mask=both)
            tl.store(recv_w + rows[:, None] * K + ks[None, :], w, mask=both)
            bad_local = tl.sum(tl.sum((both & ((idx < -1) | (idx >= L))).to(tl.int32), axis=1), axis=0)
        if tl.sum((ok & ((tokens < 0) | (tokens >= T))).to(tl.int32), axis=0) > 0:
            fail(status, E_TOKENS, src, T, 0, 0, 0)
        elif bad_local > 0:
            fail(status, E_LOCAL, src, L, 0, 0, 0)

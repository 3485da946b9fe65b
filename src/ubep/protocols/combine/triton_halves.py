"""Normal mode's shared Triton halves: the combine that ubep and bsp both run, each half one launch over
the combine's own address table, and the status and waiting helpers of every normal-mode kernel.

    protocol (ubep, bsp) -> [combine_send_kernel, combine_reduce_kernel] -> memory (address table)

The same halves as `ubep.protocols.combine.numba_halves`, over the same memory, word
for word (`ubep.protocols.combine.blocks`): the table (int64 [R, 3, 2]) holds the
address of every block of `BackBlocks.table()` in every rank's memory for both
halves; the back header is the stamp, then dtype, topk, prefix[R + 1], dispatch.

    combine send    (row blocks): rows and weights into own Y; the last program stamps BACK
    combine reduce  (token t): waits for every live BACK stamp, checks them, sums t's rows over
                    ranks ascending in float32, unfused, rounding once

Status words (int64 [8], `ubep.protocols.combine.codes`): [0] DONE or an error code
(claimed by the first program that fails, which then writes [1:6] = peer, what it
sent, ..., expected), [WAITING_WORD] 1 + a peer some program still waits for.

Legend: see `ubep.layout`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ubep.engine.triton_kernels import _bf16_bits
from ubep.engine.triton_route import first_bad_topk
from ubep.engine.triton_sync import int64_ptr, load_acquire, load_epoch, store_release
from ubep.protocols.combine import blocks, codes

# The places of `ubep.protocols.combine.blocks` and the codes of `ubep.protocols.combine.codes`, as Triton
# constants.
BLOCKS: tl.constexpr = tl.constexpr(len(blocks.TABLE))
BACK: tl.constexpr = tl.constexpr(blocks.BACK)
Y: tl.constexpr = tl.constexpr(blocks.Y)
Y_WEIGHTS: tl.constexpr = tl.constexpr(blocks.Y_WEIGHTS)
B_DTYPE: tl.constexpr = tl.constexpr(blocks.B_DTYPE)
B_TOPK: tl.constexpr = tl.constexpr(blocks.B_TOPK)
B_PREFIX: tl.constexpr = tl.constexpr(blocks.B_PREFIX)
WAITING_WORD: tl.constexpr = tl.constexpr(codes.WAITING_WORD)
E_FIELD: tl.constexpr = tl.constexpr(codes.E_FIELD)
E_OTHER_CALL: tl.constexpr = tl.constexpr(codes.E_OTHER_CALL)
E_ROWS: tl.constexpr = tl.constexpr(codes.E_ROWS)
E_OWN_EXPERT: tl.constexpr = tl.constexpr(codes.E_OWN_EXPERT)
E_OWN_REPEATED: tl.constexpr = tl.constexpr(codes.E_OWN_REPEATED)

# Element kinds of combine's rows and output (the payload dtypes a Buffer accepts).
F32: tl.constexpr = tl.constexpr(0)
BF16: tl.constexpr = tl.constexpr(1)


@triton.jit
def _address(table, rank, block, half):
    """Address (int64) of `block` in `rank`'s memory for this half (the combine's table)."""
    return tl.load(table + (rank * BLOCKS + block) * 2 + half)


@triton.jit
def fail(status, code, peer, a, b, c, d):
    """Claim the status word with an error (the first program to fail wins) and write its details."""
    unclaimed = tl.full((), 0, tl.int64)
    if tl.atomic_cas(status, unclaimed, unclaimed + code, sem="relaxed", scope="gpu") == 0:
        tl.store(status + 1, peer)  # stored as int64, the pointer's type
        tl.store(status + 2, a)
        tl.store(status + 3, b)
        tl.store(status + 4, c)
        tl.store(status + 5, d)


@triton.jit
def failed(status):
    """Whether a program of this call already failed (then the rest stop early)."""
    return tl.load(status) != 0


@triton.jit
def own_topk_ok(topk, N, K, E, status, me, NB: tl.constexpr, KB: tl.constexpr):
    """This rank's topk_idx [N, K] (`triton_route.first_bad_topk`): 1 good; 0 failed, the status
    claimed with E_OWN_EXPERT (value, E, row) or E_OWN_REPEATED (expert, 0, row)."""
    bad_at, bad_value, twice_row, twice_expert = first_bad_topk(topk, N, K, E, NB, KB)
    ok = tl.full((), 1, tl.int32)
    if bad_at < N * KB:
        fail(status, E_OWN_EXPERT, me, bad_value, E, bad_at // KB, 0)
        ok = tl.full((), 0, tl.int32)
    elif twice_row < N:
        fail(status, E_OWN_REPEATED, me, twice_expert, 0, twice_row, 0)
        ok = tl.full((), 0, tl.int32)
    return ok


@triton.jit
def await_stamp(stamp, epoch, status, peer, max_spins):
    """Wait (bounded) for the stamp at `stamp` to read `epoch`: 1 landed, 0 the wait ran out (the peer
    is marked as awaited). Once a program of this launch ran out, later waits poll once: the launch
    stops waiting either way (where programs run in turn, as in the interpreter, none spins in vain)."""
    seen = load_acquire(stamp)
    spins = tl.full((), 0, tl.int32)
    if tl.load(status + WAITING_WORD) != 0:
        spins = max_spins + spins
    while (seen != epoch) & (spins < max_spins):
        seen = load_acquire(stamp)
        spins += 1
    landed = 1
    if seen != epoch:
        landed = 0
        awaited = tl.full((), 1, tl.int64) + peer
        tl.atomic_xchg(status + WAITING_WORD, awaited, sem="relaxed", scope="gpu")
    return landed


@triton.jit
def copy_words(src, dst, rows_src, rows_dst, ok, W, WB: tl.constexpr):
    """dst[rows_dst[i], :W] = src[rows_src[i], :W] (word pointers, row stride W) where ok[i]."""
    c0 = 0
    while c0 < W:
        cols = c0 + tl.arange(0, WB)
        both = ok[:, None] & (cols[None, :] < W)
        words = tl.load(src + rows_src[:, None] * W + cols[None, :], mask=both)
        tl.store(dst + rows_dst[:, None] * W + cols[None, :], words, mask=both)
        c0 += WB


@triton.jit
def combine_send_kernel(
    table, me, epochs, y, W, weights, K, Kmax, prefix, R, seq, code, arrivals, programs,
    WORD: tl.constexpr, IB: tl.constexpr, KB: tl.constexpr, RB: tl.constexpr, WB: tl.constexpr,
):  # fmt: skip
    """An expert rank's half of combine: program i puts rows [i * IB, (i + 1) * IB) of y [M, W] words
    (only the prefix[R] rows its dispatch received: y may be padded) and their weights (float32
    [M, K], K may be 0) into its own Y and Y_WEIGHTS; the last program to arrive writes the back header
    (code, K, prefix int64 [R + 1], the dispatch's seq) and stamps BACK."""
    epoch, half = load_epoch(epochs)
    i = tl.program_id(0)
    M = tl.load(prefix + R)
    rows = (i * IB + tl.arange(0, IB)).to(tl.int64)
    ok = rows < M
    own_y = _address(table, me, Y, half).to(tl.pointer_type(WORD))
    copy_words(y, own_y, rows, rows, ok, W, WB)
    if K > 0:
        ks = tl.arange(0, KB)
        both = ok[:, None] & (ks[None, :] < K)
        w = tl.load(weights + rows[:, None] * K + ks[None, :], mask=both)
        own_w = _address(table, me, Y_WEIGHTS, half).to(tl.pointer_type(tl.float32))
        tl.store(own_w + rows[:, None] * Kmax + ks[None, :], w, mask=both)
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals, 1, sem="acq_rel", scope="sys")
    if arrived == programs - 1:  # the last program: every row is ordered before this
        back = int64_ptr(_address(table, me, BACK, half))
        tl.store(back + B_DTYPE, code)  # stored as int64, the pointer's type
        tl.store(back + B_TOPK, K)
        rs = tl.arange(0, RB)
        tl.store(back + B_PREFIX + rs, tl.load(prefix + rs, mask=rs <= R), mask=rs <= R)
        tl.store(back + B_PREFIX + R + 1, seq)
        tl.debug_barrier()
        store_release(_address(table, me, BACK, half), epoch)


@triton.jit
def combine_reduce_kernel(
    table, live, me, epochs, R, N, in_rank, place, send_counts, seq, code, dtype_lo, dtype_hi, K, Kmax,
    rows_max, out, H, out_w, state, status, max_spins,
    KIND: tl.constexpr, RB: tl.constexpr, KB: tl.constexpr, HB: tl.constexpr,
):  # fmt: skip
    """The home's half of combine, program t (token; max(N, 1) programs): once every live expert rank's
    back header landed, check them all as `numba_halves.combine_reduce` does (in its order), then
    out[t] = the sum of t's rows over ranks ascending (the reference's order) in float32, unfused,
    rounded once (KIND BF16: bf16 bits as int16, by integer rounding; F32: float32), and
    out_w[t, :K] the sum of their weights.

    in_rank uint8 [N, R] and send_counts int64 [R] come from the dispatch's handle; place int64 [N, R]
    is t's row among the rows this rank sent to r (an exclusive cumulative sum of in_rank). state
    int64 [N] (zeroed for the call): 1 once t is finished (a second launch skips it).
    """
    epoch, half = load_epoch(epochs)
    t = tl.program_id(0)
    if tl.load(state + t) == 0:
        go = tl.full((), 1, tl.int32)
        p = tl.full((), 0, tl.int32)
        while (go != 0) & (p < R):
            if tl.load(live + p) != 0:
                if await_stamp(_address(table, p, BACK, half), epoch, status, p, max_spins) == 0:
                    go = tl.full((), 0, tl.int32)
            p += 1
        rs = tl.arange(0, RB)
        begins = tl.zeros((RB,), tl.int64)  # each live rank's header words, loaded once: checked, then used
        rows_R = tl.zeros((RB,), tl.int64)
        dtypes = tl.zeros((RB,), tl.int64)
        topks = tl.zeros((RB,), tl.int64)
        seqs = tl.zeros((RB,), tl.int64)
        p = tl.full((), 0, tl.int32)
        while (go != 0) & (p < R):  # bounds, field by field
            if tl.load(live + p) != 0:
                words = int64_ptr(_address(table, p, BACK, half))
                dtype = tl.load(words + B_DTYPE)
                topk = tl.load(words + B_TOPK)
                prefix = tl.load(words + B_PREFIX + rs, mask=rs <= R, other=0)
                theirs = tl.load(words + B_PREFIX + R + 1)
                begin = tl.sum(tl.where(rs == me, prefix, 0), axis=0)
                begins = tl.where(rs == p, begin, begins)
                rows_R = tl.where(rs == p, tl.sum(tl.where(rs == me + 1, prefix, 0), axis=0) - begin, rows_R)
                dtypes = tl.where(rs == p, dtype, dtypes)
                topks = tl.where(rs == p, topk, topks)
                seqs = tl.where(rs == p, theirs, seqs)
                bad = (rs <= R) & ((prefix < 0) | (prefix > rows_max))
                first_bad = tl.min(tl.where(bad, rs, RB), axis=0)
                bad_value = tl.sum(tl.where(rs == first_bad, prefix, 0), axis=0)
                if (dtype < dtype_lo) | (dtype > dtype_hi):
                    fail(status, E_FIELD, p, dtype, 0, 0, 0)
                    go = tl.full((), 0, tl.int32)
                elif (topk < 0) | (topk > Kmax):
                    fail(status, E_FIELD, p, topk, 1, 0, 0)
                    go = tl.full((), 0, tl.int32)
                elif first_bad < RB:
                    fail(status, E_FIELD, p, bad_value, 2, 0, 0)
                    go = tl.full((), 0, tl.int32)
            p += 1
        p = tl.full((), 0, tl.int32)
        while (go != 0) & (p < R):
            if tl.load(live + p) != 0:
                theirs = tl.sum(tl.where(rs == p, seqs, 0), axis=0)
                if theirs != seq:
                    fail(status, E_OTHER_CALL, p, theirs, 0, 0, 0)
                    go = tl.full((), 0, tl.int32)
            p += 1
        p = tl.full((), 0, tl.int32)
        while (go != 0) & (p < R):
            if tl.load(live + p) != 0:
                rows = tl.sum(tl.where(rs == p, rows_R, 0), axis=0)
                dtype = tl.sum(tl.where(rs == p, dtypes, 0), axis=0)
                topk = tl.sum(tl.where(rs == p, topks, 0), axis=0)
                want = tl.load(send_counts + p)
                if (rows != want) | (dtype != code) | (topk != K):
                    fail(status, E_ROWS, p, rows, dtype, topk, want)
                    go = tl.full((), 0, tl.int32)
            p += 1
        if (go != 0) & (t < N):
            c0 = 0
            while c0 < H:
                cols = c0 + tl.arange(0, HB)
                m = cols < H
                acc = tl.zeros((HB,), tl.float32)
                r = tl.full((), 0, tl.int32)
                while r < R:
                    if tl.load(in_rank + t * R + r) != 0:
                        row = tl.sum(tl.where(rs == r, begins, 0), axis=0) + tl.load(place + t * R + r)
                        base = _address(table, r, Y, half)
                        if KIND == BF16:
                            v = tl.load(base.to(tl.pointer_type(tl.bfloat16)) + row * H + cols, mask=m)
                        else:
                            v = tl.load(base.to(tl.pointer_type(tl.float32)) + row * H + cols, mask=m)
                        acc = acc + v.to(tl.float32)
                    r += 1
                if KIND == BF16:
                    tl.store(out + t.to(tl.int64) * H + cols, _bf16_bits(acc), mask=m)
                else:
                    tl.store(out + t.to(tl.int64) * H + cols, acc, mask=m)
                c0 += HB
            if K > 0:
                ks = tl.arange(0, KB)
                acc_w = tl.zeros((KB,), tl.float32)
                r = tl.full((), 0, tl.int32)
                while r < R:
                    if tl.load(in_rank + t * R + r) != 0:
                        row = tl.sum(tl.where(rs == r, begins, 0), axis=0) + tl.load(place + t * R + r)
                        w_at = _address(table, r, Y_WEIGHTS, half).to(tl.pointer_type(tl.float32))
                        acc_w = acc_w + tl.load(w_at + row * Kmax + ks, mask=ks < K, other=0.0)
                    r += 1
                tl.store(out_w + t * K + ks, acc_w, mask=ks < K)
        if (go != 0) | failed(status):  # finished (summed, or failed): a relaunch skips it
            tl.store(state + t, 1)

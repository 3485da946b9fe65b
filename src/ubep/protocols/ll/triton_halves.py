"""Low-latency mode's call halves as Triton kernels: each half one launch over the Buffer's address table.

    protocol (ll: slots, reuse words, status words) -> [these kernels] -> memory (address table)

The same halves as `ubep.protocols.ll.numba_halves` (numba), over the same memory,
word for word: the table (int64 [R, 7, 2]) holds the address of every block of
`LLBlocks.all()` in every rank's memory for both halves; headers are inbox
records, stamp first. On a GPU the addresses are device addresses (the CUDA
heap's), under Triton's interpreter host addresses (the shared-memory heap's),
so the interpreter runs these kernels across processes as a GPU runs them
across devices.

Ordering (docs/device.md has the argument): a program's rows and record
words are plain stores, then a block barrier, then a system-scope release (the
stamp itself, or an arrival on a counter whose last arrival stamps); a reader
polls a stamp with a system-scope acquire before it reads anything the stamp
covers. Every poll is bounded by `max_spins`: a program that runs out marks
the peer it waits for in the status word and stops, without arriving, so the
host may launch the half again (it resumes from `state`) or report a timeout.

No host reads: every count, position and check is computed in the kernel
from device tensors; results and errors go to device words the host reads
after the call (`ubep.protocols.ll.triton_driver`).

The call's epoch is read from a device word (`epochs`, int64 [1]), not passed
by value, so that a captured graph's replays are successive calls: the host
sets it, or a kernel in the graph advances it. Its parity is the half of
every double-buffered block.

Rows travel in one of the two data-as-flag forms (`IN_WORD`, a compile-time switch):
- after data: rows as plain words, covered by the record's stamp (released after them);
- in word: each row of B bytes as B / 4 int64 words, (epoch << 32) | 4 payload bytes, each written
  by one relaxed system-scope 8-byte atomic, after the stamp (which then covers only the counts and
  slot infos); a receiver polls every word it reads (volatile, bounded) until its high half is the
  epoch. Slot rows take twice the bytes (`slot_bytes`).

This rank's own inputs (topk_idx, and in combine the handle) are checked in the send kernels, by
every program, before any of them writes: the host reads no value of them on the device path. A
bad input fails the call (E_EXPERT, ...) and raises this rank's `rejected` word, so the peers' receive
halves stop with E_REJECTED instead of waiting.

Status words (int64 [8]): [0] DONE or an error code (claimed by the first
program that fails, which then writes [1:5] = peer, what it sent, ..., expected,
as `numba_halves`), [5] 1 + a peer some program still waits for (0: none).

Legend: see `ubep.protocols.ll.plans` (L local experts, M = R * T rows per expert).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ubep.engine.triton_kernels import _bf16_bits
from ubep.engine.triton_route import first_bad_topk
from ubep.engine.triton_sync import int64_ptr, load_acquire, load_epoch, store_release
from ubep.protocols.ll import blocks, codes

# The places of `ubep.protocols.ll.blocks` and the codes of `ubep.protocols.ll.codes`, as Triton constants.
BLOCKS: tl.constexpr = tl.constexpr(len(blocks.TABLE))
SENT: tl.constexpr = tl.constexpr(blocks.SENT)
SLOTS: tl.constexpr = tl.constexpr(blocks.SLOTS)
SLOT_INFO: tl.constexpr = tl.constexpr(blocks.SLOT_INFO)
RETURNED: tl.constexpr = tl.constexpr(blocks.RETURNED)
BACK_SLOTS: tl.constexpr = tl.constexpr(blocks.BACK_SLOTS)
DONE_WORDS: tl.constexpr = tl.constexpr(blocks.DONE_WORDS)
REJECTED: tl.constexpr = tl.constexpr(blocks.REJECTED)
CONSUMED: tl.constexpr = tl.constexpr(blocks.CONSUMED)
S_DTYPE: tl.constexpr = tl.constexpr(blocks.S_DTYPE)  # sent record: stamp, dtype, T, width, counts[L]
S_T: tl.constexpr = tl.constexpr(blocks.S_T)
S_WIDTH: tl.constexpr = tl.constexpr(blocks.S_WIDTH)
S_COUNTS: tl.constexpr = tl.constexpr(blocks.S_COUNTS)
R_DTYPE: tl.constexpr = tl.constexpr(blocks.R_DTYPE)  # returned record: stamp, dtype, count
R_COUNT: tl.constexpr = tl.constexpr(blocks.R_COUNT)
R_WORDS: tl.constexpr = tl.constexpr(1 + len(blocks.RETURNED_FIELDS))

WAITING_WORD: tl.constexpr = tl.constexpr(codes.WAITING_WORD)  # status[5]: 1 + the peer still awaited
E_FIELD: tl.constexpr = tl.constexpr(codes.E_FIELD)
E_REJECTED: tl.constexpr = tl.constexpr(codes.E_REJECTED)
E_T: tl.constexpr = tl.constexpr(codes.E_T)
E_FORMAT: tl.constexpr = tl.constexpr(codes.E_FORMAT)
E_COUNTS: tl.constexpr = tl.constexpr(codes.E_COUNTS)
E_TOKENS: tl.constexpr = tl.constexpr(codes.E_TOKENS)
E_RETURNED: tl.constexpr = tl.constexpr(codes.E_RETURNED)
E_MINE: tl.constexpr = tl.constexpr(codes.E_MINE)
E_EXPERT: tl.constexpr = tl.constexpr(codes.E_EXPERT)
E_REPEATED: tl.constexpr = tl.constexpr(codes.E_REPEATED)
E_UNRECEIVED: tl.constexpr = tl.constexpr(codes.E_UNRECEIVED)
E_OTHER_TOPK: tl.constexpr = tl.constexpr(codes.E_OTHER_TOPK)
E_TOO_MANY: tl.constexpr = tl.constexpr(codes.E_TOO_MANY)


@triton.jit
def _address(table, rank, block, half):
    """Address (int64) of `block` in `rank`'s memory for this half."""
    return tl.load(table + (rank * BLOCKS + block) * 2 + half)


@triton.jit
def _done_word(table, rank, kind, half, word):
    """Address of rank's done[kind, half, word] (CONSUMED 0, SKIPPED 1)."""
    return _address(table, rank, DONE_WORDS, 0) + ((kind * 2 + half) * 2 + word) * 8


@triton.jit
def _fail(status, code, peer, a, b, c):
    """Claim the status word with an error (the first program to fail wins) and write its details."""
    unclaimed = tl.full((), 0, tl.int64)
    if tl.atomic_cas(status, unclaimed, unclaimed + code, sem="relaxed", scope="gpu") == 0:
        tl.store(status + 1, peer)  # stored as int64, the pointer's type
        tl.store(status + 2, a)
        tl.store(status + 3, b)
        tl.store(status + 4, c)


@triton.jit
def _spent(status, max_spins):
    """Polls a new wait starts with: none spent, or all of them once a program of this launch ran out
    (the launch stops waiting either way; where programs run in turn, as in the interpreter, the
    ones after it then do not spin in vain)."""
    spins = tl.full((), 0, tl.int32)
    if tl.load(status + WAITING_WORD) != 0:
        spins = max_spins + spins
    return spins


@triton.jit
def _awaiting(status, peer):
    """Mark `peer` as the one a wait of this launch ran out on (the host sleeps on it, or reports it)."""
    tl.atomic_xchg(status + WAITING_WORD, peer.to(tl.int64) + 1, sem="relaxed", scope="gpu")


@triton.jit
def _reject(table, me, kind, epoch):
    """This rank's input failed a check: raise its `rejected` word for this kind to the epoch (a
    system-scope release), so that peers' receive halves stop with E_REJECTED instead of waiting."""
    tl.debug_barrier()
    tl.atomic_max(int64_ptr(_address(table, me, REJECTED, 0) + kind * 8), epoch, sem="release", scope="sys")


@triton.jit
def _put_words(dst, words, mask, epoch):
    """Data as flag: each int32 payload word as the int64 (epoch << 32) | payload, by one relaxed
    system-scope 8-byte atomic, so a reader sees the old word or the whole new one."""
    stamped = ((epoch & 0xFFFFFFFF) << 32) | words.to(tl.uint32, bitcast=True).to(tl.int64)
    tl.atomic_xchg(dst, stamped, mask=mask, sem="relaxed", scope="sys")


@triton.jit
def _poll_words(src, mask, epoch, status, max_spins):
    """Data as flag: (the int64 words at src, 1 once every masked one carries the epoch in its high
    half, else 0 after `max_spins` more volatile reads). A word of another epoch (an older call's, or
    memory never written) is not read as landed."""
    want = epoch.to(tl.int32)
    words = tl.load(src, mask=mask, other=0, volatile=True)
    late = tl.sum(tl.ravel((mask & ((words >> 32).to(tl.int32) != want)).to(tl.int32)), axis=0)
    spins = _spent(status, max_spins)
    while (late > 0) & (spins < max_spins):
        words = tl.load(src, mask=mask, other=0, volatile=True)
        late = tl.sum(tl.ravel((mask & ((words >> 32).to(tl.int32) != want)).to(tl.int32)), axis=0)
        spins += 1
    return words, (late == 0).to(tl.int32)


@triton.jit
def _check_topk(topk, N, K, E, status, me, NB: tl.constexpr, KB: tl.constexpr):
    """This rank's topk_idx [N, K] (`triton_route.first_bad_topk`: a value out of range anywhere first,
    then the first row with a repeat). 1 good, 0 failed (E_EXPERT or E_REPEATED)."""
    bad_at, bad_value, twice_row, twice_expert = first_bad_topk(topk, N, K, E, NB, KB)
    ok = tl.full((), 0, tl.int32)
    if bad_at < N * KB:
        _fail(status, E_EXPERT, me, bad_value, E.to(tl.int64), (bad_at // KB).to(tl.int64))
    elif twice_row < N:
        _fail(status, E_REPEATED, me, twice_expert, 0, twice_row.to(tl.int64))
    else:
        ok = tl.full((), 1, tl.int32)
    return ok


@triton.jit
def _wait_reusable(table, status, me, peer, kind, half, epoch, max_spins):
    """Wait (bounded) until `peer` consumed call epoch - 2 of this kind, which used this half.

    Returns 1 when it may be written, 0 when the wait ran out, -1 on an error (in status)."""
    before = epoch - 2
    ok = 1
    if load_acquire(_done_word(table, me, kind, half, CONSUMED)) < before:
        _fail(status, E_MINE, me, before, 0, 0)
        ok = -1
    else:
        seen = load_acquire(_done_word(table, peer, kind, half, CONSUMED))
        spins = _spent(status, max_spins)
        while (seen < before) & (spins < max_spins):
            seen = load_acquire(_done_word(table, peer, kind, half, CONSUMED))
            spins += 1
        if seen < before:
            _awaiting(status, peer)
            ok = 0
    return ok


@triton.jit
def _wait_stamp(table, status, me, peer, kind, header, half, stamp, epoch, max_spins):
    """Wait (bounded) for `peer`'s stamp (at address `stamp`) to read `epoch`: 1 landed, 0 the wait
    ran out (the peer is marked as awaited), -1 the peer rejected the call (an error)."""
    seen = load_acquire(stamp)
    rejected = load_acquire(_address(table, peer, REJECTED, 0) + kind * 8)
    spins = _spent(status, max_spins)
    while (seen != epoch) & (rejected < epoch) & (spins < max_spins):
        seen = load_acquire(stamp)
        rejected = load_acquire(_address(table, peer, REJECTED, 0) + kind * 8)
        spins += 1
    landed = 1
    if seen != epoch:
        landed = 0
        if rejected >= epoch:
            _fail(status, E_REJECTED, peer, 0, 0, 0)
            landed = -1
        else:
            _awaiting(status, peer)
    return landed


@triton.jit
def _arrive_and_release(table, me, kind, half, epoch, arrivals, programs):
    """Every program of a receive half arrives once it is finished; the last one publishes
    "consumed" (the max of the epoch and a skipped call's), so peers may reuse this half."""
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals, 1, sem="acq_rel", scope="gpu")
    if arrived == programs - 1:
        skipped = load_acquire(_done_word(table, me, kind, half, 1))
        store_release(_done_word(table, me, kind, half, CONSUMED), tl.maximum(skipped, epoch))


# -- dispatch -------------------------------------------------------------------------------------


@triton.jit
def _hits(topk, t0, N, K, expert, count, NB: tl.constexpr, KB: tl.constexpr):
    """Tokens t0 .. t0 + NB: (tokens, 1 where a token selected `expert`, its k, its slot: `count`
    plus the hits before it)."""
    tokens = t0 + tl.arange(0, NB)
    ks = tl.arange(0, KB)
    chosen = tl.load(
        topk + tokens[:, None] * K + ks[None, :], mask=(tokens[:, None] < N) & (ks[None, :] < K), other=-1
    )
    match = chosen == expert
    hit = tl.sum(match.to(tl.int64), axis=1)  # 0 or 1: an expert appears once in a row (checked)
    k = tl.sum(tl.where(match, ks[None, :], 0), axis=1)
    return tokens, hit, k, count + tl.cumsum(hit, axis=0) - 1


@triton.jit
def ll_dispatch_send_kernel(
    table, live, me, epochs, rows, topk, N, K, E, experts, L, code, T, Kmax, Tcap, slot_words,
    slot_bytes, W, width, arrivals, progress, status, max_spins,
    WORD: tl.constexpr, IN_WORD: tl.constexpr, NB: tl.constexpr, KB: tl.constexpr, WB: tl.constexpr,
):  # fmt: skip
    """Program (d, j): put every token that selected expert experts[d, j] into d's slots for
    (this rank, j), in token order, with token * Kmax + k beside it; the last of d's L programs
    stamps this rank's record in d (dtype, T, width, counts). Every program first checks the whole
    topk (values in [-1, E), no repeats): a bad one fails the call before anything is sent.

    rows [N, W] words, `width` bytes (this rank's tokens in wire form); topk int64 [N, K]; experts int64
    [R, L] the global id of each (rank, local expert); a slot row is slot_words words of WORD (or
    int64 words, IN_WORD), slot_bytes bytes; arrivals int64 [R], progress int64 [R, L] (1: sent) start
    zeroed for the call. IN_WORD: rows as epoch words (int32 payloads), after the stamp.
    """
    epoch, half = load_epoch(epochs)
    d = tl.program_id(0)
    j = tl.program_id(1)
    go = (tl.load(live + d) != 0) & (tl.load(progress + d * L + j) == 0)
    if go:
        ok = _check_topk(topk, N, K, E, status, me, NB, KB)
        if ok == 0:
            _reject(table, me, 0, epoch)
        go = ok == 1
    if go:
        go = _wait_reusable(table, status, me, d, 0, half, epoch, max_spins) == 1
    if go:
        expert = tl.load(experts + d * L + j)
        slots = _address(table, d, SLOTS, half) + (me * L + j).to(tl.int64) * Tcap * slot_bytes
        info = int64_ptr(_address(table, d, SLOT_INFO, half)) + (me * L + j).to(tl.int64) * Tcap
        count = tl.full((), 0, tl.int64)
        t0 = 0
        while t0 < N:
            tokens, hit, k, pos = _hits(topk, t0, N, K, expert, count, NB, KB)
            tl.store(info + pos, tokens.to(tl.int64) * Kmax + k, mask=hit != 0)
            if not IN_WORD:  # the rows before the stamp, which covers them
                _put_rows(rows, tokens, hit, pos, W, slots.to(tl.pointer_type(WORD)), slot_words, epoch,
                          False, WB)  # fmt: skip
            count += tl.sum(hit, axis=0)
            t0 += NB
        record = int64_ptr(_address(table, d, SENT, half)) + me * (S_COUNTS + L)
        tl.store(record + S_COUNTS + j, count)
        tl.store(progress + d * L + j, 1)
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals + d, 1, sem="acq_rel", scope="sys")
        if arrived == L - 1:  # the last of d's programs: every row for d is ordered before this
            tl.store(record + S_DTYPE, code.to(tl.int64))
            tl.store(record + S_T, T.to(tl.int64))
            tl.store(record + S_WIDTH, width.to(tl.int64))
            tl.debug_barrier()
            store_release(_address(table, d, SENT, half) + me * (S_COUNTS + L) * 8, epoch)
        if IN_WORD:  # each word its own flag: the rows after the stamp, which covers only counts and infos
            count = tl.full((), 0, tl.int64)
            t0 = 0
            while t0 < N:
                tokens, hit, k, pos = _hits(topk, t0, N, K, expert, count, NB, KB)
                _put_rows(rows, tokens, hit, pos, W, slots.to(tl.pointer_type(tl.int64)), slot_words, epoch,
                          True, WB)  # fmt: skip
                count += tl.sum(hit, axis=0)
                t0 += NB


@triton.jit
def _put_rows(rows, tokens, hit, pos, W, dst, slot_words, epoch, IN_WORD: tl.constexpr, WB: tl.constexpr):
    """rows[tokens] (W words each, where hit) -> dst + pos * slot_words: plain stores, or epoch words."""
    c0 = 0
    while c0 < W:
        cols = c0 + tl.arange(0, WB)
        both = (hit[:, None] != 0) & (cols[None, :] < W)
        words = tl.load(rows + tokens[:, None].to(tl.int64) * W + cols[None, :], mask=both)
        at = dst + pos[:, None] * slot_words + cols[None, :]
        if IN_WORD:
            _put_words(at, words, both, epoch)
        else:
            tl.store(at, words, mask=both)
        c0 += WB


@triton.jit
def _check_sent(record, status, src, j, L, code, T, Tcap, row_bytes, width, dtype_lo, dtype_hi,
                LB: tl.constexpr):  # fmt: skip
    """The numba `ll_dispatch_recv`'s checks of a landed record, in its order: (1 good or 0 failed, the
    record's count for local expert j). Every word is loaded once: the count returned is the one checked."""
    dtype = tl.load(record + S_DTYPE)
    their_T = tl.load(record + S_T)
    their_width = tl.load(record + S_WIDTH)
    ls = tl.arange(0, LB)
    counts = tl.load(record + S_COUNTS + ls, mask=ls < L, other=0)
    bad = (ls < L) & ((counts < 0) | (counts > Tcap))
    first_bad = tl.min(tl.where(bad, ls, LB), axis=0)
    bad_count = tl.sum(tl.where(ls == first_bad, counts, 0), axis=0)
    too_many = tl.sum(((ls < L) & (counts > T)).to(tl.int32), axis=0)
    ok = 0
    if (dtype < dtype_lo) | (dtype > dtype_hi):
        _fail(status, E_FIELD, src, dtype, 0, 0)
    elif (their_T < 0) | (their_T > Tcap):
        _fail(status, E_FIELD, src, their_T, 1, 0)
    elif (their_width < 0) | (their_width > row_bytes):
        _fail(status, E_FIELD, src, their_width, 2, 0)
    elif first_bad < LB:
        _fail(status, E_FIELD, src, bad_count, 3, 0)
    elif their_T != T:
        _fail(status, E_T, src, their_T, 0, 0)
    elif (dtype != code) | (their_width != width):
        _fail(status, E_FORMAT, src, 0, 0, 0)
    elif too_many > 0:
        _fail(status, E_COUNTS, src, 0, 0, 0)
    else:
        ok = 1
    return ok, tl.sum(tl.where(ls == j, counts, 0), axis=0)


@triton.jit
def _take_rows(held, lo, W, plane, row, m, epoch, status, max_spins, IN_WORD: tl.constexpr,
               WB: tl.constexpr):  # fmt: skip
    """Words lo .. lo + W of the slot rows `held` (pointers [IB, 1]) -> plane[row] (W words a row, where
    m): 1 done; IN_WORD, 0 when a word did not carry the epoch within the polls (the rest is left)."""
    landed = tl.full((), 1, tl.int32)
    c0 = 0
    while (landed != 0) & (c0 < W):
        cols = c0 + tl.arange(0, WB)
        both = m[:, None] & (cols[None, :] < W)
        if IN_WORD:
            words, landed = _poll_words(held + lo + cols[None, :], both, epoch, status, max_spins)
            words = words.to(tl.int32)  # the payload: the low half
        else:
            words = tl.load(held + lo + cols[None, :], mask=both)
        if landed != 0:
            tl.store(plane + row[:, None] * W + cols[None, :], words, mask=both)
        c0 += WB
    return landed


@triton.jit
def ll_dispatch_recv_kernel(
    table, live, me, epochs, R, L, code, T, Kmax, Tcap, slot_words, slot_bytes, row_bytes, width,
    dtype_lo, dtype_hi, plane0, W0, plane1, W1, M, src_token, src_rank, src_k, layout_range,
    recv_count, state, arrivals, status, max_spins,
    WORD: tl.constexpr, IN_WORD: tl.constexpr, LB: tl.constexpr, IB: tl.constexpr, WB: tl.constexpr,
):  # fmt: skip
    """Program (j, src): place source src's rows for local expert j after the rows of the live
    sources before it (whose records it waits for too, to read their counts for j): plane0
    [L, M, W0] and plane1 [L, M, W1] words receive each row's first W0 and next W1 words (W1 = 0
    unless FP8: values, then scales); src_token, src_rank, src_k int64 [L, M], layout_range
    int64 [L, R, 2], recv_count int32 [L] (by program (j, R - 1)). IN_WORD: slot rows are epoch words
    (int64), polled until they carry the epoch; planes are int32 words.

    state int64 [L, R] (zeroed for the call): 1 once the program finished, so that a launch after
    a wait ran out runs only the programs still waiting. The last program to finish releases
    the half.
    """
    epoch, half = load_epoch(epochs)
    j = tl.program_id(0)
    src = tl.program_id(1)
    if tl.load(state + j * R + src) == 0:
        go = tl.full((), 1, tl.int32)
        waiting = tl.full((), 0, tl.int32)
        begin = tl.full((), 0, tl.int64)
        s = 0
        while (go != 0) & (s <= src):  # every live source up to src has landed; count j's rows before
            if tl.load(live + s) != 0:
                stamp = _address(table, me, SENT, half) + s * (S_COUNTS + L) * 8
                landed = _wait_stamp(table, status, me, s, 0, SENT, half, stamp, epoch, max_spins)
                if landed != 1:
                    go = tl.full((), 0, tl.int32)
                    waiting = tl.full((), 1, tl.int32) * (landed == 0)
                elif s < src:
                    before = tl.load(int64_ptr(stamp) + S_COUNTS + j)  # loaded once: checked, then used
                    if (before < 0) | (before > T):  # (that source's own program may have seen another)
                        _fail(status, E_FIELD, s, before, 3, 0)
                        go = tl.full((), 0, tl.int32)
                    else:
                        begin += before
            s += 1
        n = tl.full((), 0, tl.int64)
        if (go != 0) & (tl.load(live + src) != 0):
            stamp = _address(table, me, SENT, half) + src * (S_COUNTS + L) * 8
            ok, count = _check_sent(int64_ptr(stamp), status, src, j, L, code, T, Tcap, row_bytes, width,
                                    dtype_lo, dtype_hi, LB)  # fmt: skip
            if ok == 0:
                go = tl.full((), 0, tl.int32)
            else:
                n = count
                first = (src * L + j).to(tl.int64) * Tcap  # this source's slots for j
                info = int64_ptr(_address(table, me, SLOT_INFO, half)) + first
                slots = _address(table, me, SLOTS, half) + first * slot_bytes
                if IN_WORD:
                    slots = slots.to(tl.pointer_type(tl.int64))
                else:
                    slots = slots.to(tl.pointer_type(WORD))
                i0 = 0
                while (go != 0) & (i0 < n):
                    ii = i0 + tl.arange(0, IB)
                    m = ii < n
                    infos = tl.load(info + ii, mask=m, other=0)
                    tokens = infos // Kmax
                    if tl.sum((m & ((infos < 0) | (tokens >= T))).to(tl.int32), axis=0) > 0:
                        _fail(status, E_TOKENS, src, 0, 0, 0)
                        go = tl.full((), 0, tl.int32)
                    else:
                        row = j * M + begin + ii
                        held = slots + ii[:, None].to(tl.int64) * slot_words  # this source's rows
                        took = _take_rows(held, 0, W0, plane0, row, m, epoch, status, max_spins, IN_WORD, WB)
                        if took != 0:
                            took = _take_rows(held, W0, W1, plane1, row, m, epoch, status, max_spins,
                                              IN_WORD, WB)  # fmt: skip
                        if took == 0:  # in word: a word of these rows has not landed yet
                            _awaiting(status, src)
                            go = tl.full((), 0, tl.int32)
                            waiting = tl.full((), 1, tl.int32)
                        else:
                            tl.store(src_token + row, tokens, mask=m)
                            tl.store(src_k + row, infos % Kmax, mask=m)
                            tl.store(src_rank + row, tl.zeros((IB,), tl.int64) + src, mask=m)
                    i0 += IB
        if go != 0:  # masked sources place nothing: (begin, 0)
            tl.store(layout_range + (j * R + src) * 2, begin)
            tl.store(layout_range + (j * R + src) * 2 + 1, n)
            if src == R - 1:
                tl.store(recv_count + j, (begin + n).to(tl.int32))
        if waiting == 0:  # finished (placed its rows, or failed): arrive once
            tl.store(state + j * R + src, 1)
            _arrive_and_release(table, me, 0, half, epoch, arrivals, L * R)


# -- combine --------------------------------------------------------------------------------------


@triton.jit
def _check_return(topk, given, N, K, recv_count, L, layout_range, R, per_writer, status, me,
                  LB: tl.constexpr, RB: tl.constexpr, NB: tl.constexpr, KB: tl.constexpr):  # fmt: skip
    """A combine's own inputs, as the host checks them elsewhere: the handle's dispatch was received
    (recv_count [L] >= 0), topk_idx `given` [N, K] is the dispatch's `topk`, and no home sent more
    rows than its tokens can select here (the rows per home in layout_range [L, R, 2] <= per_writer).
    1 good, 0 failed."""
    ls = tl.arange(0, LB)
    ok = tl.full((), 0, tl.int32)
    if tl.min(tl.load(recv_count + ls, mask=ls < L, other=0), axis=0) < 0:
        _fail(status, E_UNRECEIVED, me, 0, 0, 0)
    else:
        ks = tl.arange(0, KB)
        row = N
        t0 = 0
        while (row == N) & (t0 < N):
            tokens = t0 + tl.arange(0, NB)
            inside = (tokens[:, None] < N) & (ks[None, :] < K)
            at = tokens[:, None] * K + ks[None, :]
            differs = tl.load(topk + at, mask=inside, other=0) != tl.load(given + at, mask=inside, other=0)
            row = tl.min(tl.where(tl.max(differs.to(tl.int32), axis=1) != 0, tokens, N), axis=0)
            t0 += NB
        rs = tl.arange(0, RB)
        both = (ls[:, None] < L) & (rs[None, :] < R)
        rows = tl.sum(
            tl.load(layout_range + (ls[:, None] * R + rs[None, :]) * 2 + 1, mask=both, other=0), axis=0
        )
        home = tl.min(tl.where(rows > per_writer, rs, RB), axis=0)
        if row < N:
            _fail(status, E_OTHER_TOPK, me, 0, 0, row.to(tl.int64))
        elif home < RB:
            _fail(status, E_TOO_MANY, home, tl.sum(tl.where(rs == home, rows, 0), axis=0), per_writer, 0)
        else:
            ok = tl.full((), 1, tl.int32)
    return ok


@triton.jit
def ll_combine_send_kernel(
    table, live, me, epochs, x, L, M, W, layout_range, R, per_writer, slot_words,
    code, topk, given, N, K, recv_count, arrivals, progress, status, max_spins,
    WORD: tl.constexpr, IN_WORD: tl.constexpr, LB: tl.constexpr, RB: tl.constexpr, NB: tl.constexpr,
    KB: tl.constexpr, IB: tl.constexpr, WB: tl.constexpr,
):  # fmt: skip
    """Program (h, j): put each row of local expert j in x [L, M, W] words that came from home h
    (the dispatch's layout_range [L, R, 2]) into this rank's run of h's back slots (from
    me * per_writer, ordered by local expert, then token: after the rows of experts < j); the
    last of h's L programs stamps this rank's record in h (dtype, rows sent). arrivals int64 [R]
    and progress int64 [R, L] (1: sent) start zeroed for the call. Every program first checks the
    call's own inputs (`_check_return`: the dispatch's topk [N, K] and recv_count [L], the combine's
    topk `given`). IN_WORD: rows as epoch words (int32 payloads), after the stamp."""
    epoch, half = load_epoch(epochs)
    h = tl.program_id(0)
    j = tl.program_id(1)
    go = (tl.load(live + h) != 0) & (tl.load(progress + h * L + j) == 0)
    if go:
        ok = _check_return(topk, given, N, K, recv_count, L, layout_range, R, per_writer, status, me,
                           LB, RB, NB, KB)  # fmt: skip
        if ok == 0:
            _reject(table, me, 1, epoch)
        go = ok == 1
    if go:
        go = _wait_reusable(table, status, me, h, 1, half, epoch, max_spins) == 1
    if go:
        back = _address(table, h, BACK_SLOTS, half)
        begin = tl.load(layout_range + (j * R + h) * 2)
        n = tl.load(layout_range + (j * R + h) * 2 + 1)
        ls = tl.arange(0, LB)
        before = tl.sum(tl.load(layout_range + (ls * R + h) * 2 + 1, mask=ls < j, other=0), axis=0)
        if not IN_WORD:  # the rows before the stamp, which covers them
            _return_rows(x, j, M, begin, n, me * per_writer + before, W, back.to(tl.pointer_type(WORD)),
                         slot_words, epoch, False, IB, WB)  # fmt: skip
        tl.store(progress + h * L + j, 1)
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals + h, 1, sem="acq_rel", scope="sys")
        if arrived == L - 1:  # the last of h's programs: every row for h is ordered before this
            counts = tl.load(layout_range + (ls * R + h) * 2 + 1, mask=ls < L, other=0)
            record = int64_ptr(_address(table, h, RETURNED, half)) + me * R_WORDS
            tl.store(record + R_DTYPE, code.to(tl.int64))
            tl.store(record + R_COUNT, tl.sum(counts, axis=0))
            tl.debug_barrier()
            store_release(_address(table, h, RETURNED, half) + me * R_WORDS * 8, epoch)
        if IN_WORD:  # each word its own flag: the rows after the stamp, which covers only the count
            _return_rows(x, j, M, begin, n, me * per_writer + before, W, back.to(tl.pointer_type(tl.int64)),
                         slot_words, epoch, True, IB, WB)  # fmt: skip


@triton.jit
def _return_rows(x, j, M, begin, n, first, W, back, slot_words, epoch, IN_WORD: tl.constexpr,
                 IB: tl.constexpr, WB: tl.constexpr):  # fmt: skip
    """Rows begin .. begin + n of local expert j in x [L, M, W] words -> back slots first, first + 1, ...
    (slot_words apart): plain stores, or epoch words."""
    i0 = 0
    while i0 < n:
        ii = i0 + tl.arange(0, IB)
        m = ii < n
        row = j * M + begin + ii
        slot = (first + ii).to(tl.int64)
        c0 = 0
        while c0 < W:
            cols = c0 + tl.arange(0, WB)
            both = m[:, None] & (cols[None, :] < W)
            words = tl.load(x + row[:, None] * W + cols[None, :], mask=both)
            at = back + slot[:, None] * slot_words + cols[None, :]
            if IN_WORD:
                _put_words(at, words, both, epoch)
            else:
                tl.store(at, words, mask=both)
            c0 += WB
        i0 += IB


@triton.jit
def _returned_words(slot, cols, m, epoch, status, max_spins, Y_BF16: tl.constexpr):
    """In word: elements `cols` (where m) of the returned row whose epoch words start at address
    `slot`, as float32, and 1 once their words carry the epoch (else 0). A bf16 row's word i holds
    elements 2i (its low 16 bits) and 2i + 1."""
    words64 = slot.to(tl.pointer_type(tl.int64))
    if Y_BF16:
        words, landed = _poll_words(words64 + (cols >> 1), m, epoch, status, max_spins)
        bits = (words.to(tl.int32) >> ((cols & 1) * 16)) & 0xFFFF
        y = (bits << 16).to(tl.float32, bitcast=True)  # bf16 -> float32, exactly
    else:
        words, landed = _poll_words(words64 + cols, m, epoch, status, max_spins)
        y = words.to(tl.int32).to(tl.float32, bitcast=True)
    return y, landed


@triton.jit
def ll_combine_recv_kernel(
    table, me, epochs, topk, K, owner, expected, weights, code, dtype_lo, dtype_hi, count_hi,
    slots, slot_bytes, out, H, state, arrivals, programs, status, max_spins,
    Y_BF16: tl.constexpr, IN_WORD: tl.constexpr, HB: tl.constexpr,
):  # fmt: skip
    """Program t (token): wait for the record of every rank holding one of t's experts, check it,
    then out[t] = sum over k ascending of weights[t, k] * y(t, k) where topk[t, k] >= 0, in float32
    (no fused multiply-add), stored as float32 or bf16 bits (int16).

    owner int64 [E]: rank of each expert; expected int64 [R]: rows this rank expects from each
    rank; slots int64 [N, K]: the back slot of each y(t, k) (`LLTriton.return_slots`); state int64
    [N] (zeroed for the call): 1 once t is finished (a second launch skips it). IN_WORD: the back
    slots hold epoch words, each polled until it carries the epoch.
    """
    epoch, half = load_epoch(epochs)
    t = tl.program_id(0)
    if tl.load(state + t) == 0:
        go = tl.full((), 1, tl.int32)
        waiting = tl.full((), 0, tl.int32)
        k = 0
        while (go != 0) & (k < K):
            e = tl.load(topk + t * K + k)
            if e >= 0:
                r = tl.load(owner + e)
                stamp = _address(table, me, RETURNED, half) + r * R_WORDS * 8
                landed = _wait_stamp(table, status, me, r, 1, RETURNED, half, stamp, epoch, max_spins)
                if landed != 1:
                    go = tl.full((), 0, tl.int32)
                    waiting = tl.full((), 1, tl.int32) * (landed == 0)
                else:
                    dtype = tl.load(int64_ptr(stamp) + R_DTYPE)
                    count = tl.load(int64_ptr(stamp) + R_COUNT)
                    want = tl.load(expected + r)
                    if (dtype < dtype_lo) | (dtype > dtype_hi):
                        _fail(status, E_FIELD, r, dtype, 0, 0)
                        go = tl.full((), 0, tl.int32)
                    elif (count < 0) | (count > count_hi):
                        _fail(status, E_FIELD, r, count, 1, 0)
                        go = tl.full((), 0, tl.int32)
                    elif (count != want) | (dtype != code):
                        _fail(status, E_RETURNED, r, count, dtype, want)
                        go = tl.full((), 0, tl.int32)
            k += 1
        if go != 0:
            back = _address(table, me, BACK_SLOTS, half)
            c0 = 0
            while (go != 0) & (c0 < H):
                cols = c0 + tl.arange(0, HB)
                m = cols < H
                acc = tl.zeros((HB,), tl.float32)
                k = 0
                while (go != 0) & (k < K):
                    e = tl.load(topk + t * K + k)
                    if e >= 0:
                        w = tl.load(weights + t * K + k)
                        slot = back + tl.load(slots + t * K + k) * slot_bytes
                        if IN_WORD:
                            y, landed = _returned_words(slot, cols, m, epoch, status, max_spins, Y_BF16)
                            if landed == 0:
                                _awaiting(status, tl.load(owner + e))
                                go = tl.full((), 0, tl.int32)
                                waiting = tl.full((), 1, tl.int32)
                        elif Y_BF16:
                            y = tl.load(slot.to(tl.pointer_type(tl.bfloat16)) + cols, mask=m, other=0.0)
                        else:
                            y = tl.load(slot.to(tl.pointer_type(tl.float32)) + cols, mask=m, other=0.0)
                        acc = acc + y.to(tl.float32) * w
                    k += 1
                if go != 0:  # (in word, a word that has not landed leaves t to the next launch)
                    if Y_BF16:
                        tl.store(out + t.to(tl.int64) * H + cols, _bf16_bits(acc), mask=m)
                    else:
                        tl.store(out + t.to(tl.int64) * H + cols, acc, mask=m)
                c0 += HB
        if waiting == 0:
            tl.store(state + t, 1)
            _arrive_and_release(table, me, 1, half, epoch, arrivals, programs)

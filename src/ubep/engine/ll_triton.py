"""Low-latency mode's call halves as Triton kernels: each half one launch over the Buffer's address table.

    protocol (ll: slots, reuse words, status words) -> [these kernels] -> memory (address table)

The same halves as `ubep.engine.ll_halves` (numba), over the same memory,
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
after the call (`ubep.protocols.ll_device`).

The call's epoch is read from a device word (`epochs`, int64 [1]), not passed
by value, so that a captured graph's replays are successive calls: the host
sets it, or a kernel in the graph advances it. Its parity is the half of
every double-buffered block.

Status words (int64 [8]): [0] DONE or an error code (claimed by the first
program that fails, which then writes [1:5] = peer, what it sent, ..., expected,
as `ll_halves`), [5] 1 + a peer some program still waits for (0: none).

Legend: see `ubep.protocols.ll_base` (L local experts, M = R * T rows per expert).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ubep.engine.triton_kernels import _bf16_bits

# Block indices of `LLBlocks.all()`, record words and codes: those of `ubep.engine.ll_halves`.
BLOCKS: tl.constexpr = tl.constexpr(7)
SENT: tl.constexpr = tl.constexpr(0)
SLOTS: tl.constexpr = tl.constexpr(1)
SLOT_INFO: tl.constexpr = tl.constexpr(2)
RETURNED: tl.constexpr = tl.constexpr(3)
BACK_SLOTS: tl.constexpr = tl.constexpr(4)
DONE_WORDS: tl.constexpr = tl.constexpr(5)
REJECTED: tl.constexpr = tl.constexpr(6)
S_COUNTS: tl.constexpr = tl.constexpr(4)  # sent record: stamp, dtype, T, width, counts[L]
NEVER: tl.constexpr = tl.constexpr(-1)  # no polled word ever holds it: a CAS against it only reads

WAITING_WORD: tl.constexpr = tl.constexpr(5)  # status[5]: 1 + the peer still awaited (status[0] 0: DONE)
E_FIELD: tl.constexpr = tl.constexpr(2)  # the codes of `ubep.engine.ll_codes`
E_REJECTED: tl.constexpr = tl.constexpr(3)
E_T: tl.constexpr = tl.constexpr(4)
E_FORMAT: tl.constexpr = tl.constexpr(5)
E_COUNTS: tl.constexpr = tl.constexpr(6)
E_TOKENS: tl.constexpr = tl.constexpr(7)
E_RETURNED: tl.constexpr = tl.constexpr(8)
E_MINE: tl.constexpr = tl.constexpr(9)


@triton.jit
def _address(table, rank, block, half):
    """Address (int64) of `block` in `rank`'s memory for this half."""
    return tl.load(table + (rank * BLOCKS + block) * 2 + half)


@triton.jit
def _words(address):
    return address.to(tl.pointer_type(tl.int64))


@triton.jit
def _acquire(address):
    """The int64 at `address`, read with a system-scope acquire (a compare-and-swap that never matches)."""
    never = tl.full((), NEVER, tl.int64)
    return tl.atomic_cas(_words(address), never, never, sem="acquire", scope="sys")


@triton.jit
def _release(address, value):
    """Store `value` at `address` with a system-scope release: every store before it is visible first."""
    tl.atomic_xchg(_words(address), value, sem="release", scope="sys")


@triton.jit
def _epoch(epochs):
    """(the call's epoch, its half: epoch % 2), read from the device word the host or a graph set."""
    epoch = tl.load(epochs)
    return epoch, epoch & 1


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
def _wait_reusable(table, status, me, peer, kind, half, epoch, max_spins):
    """Wait (bounded) until `peer` consumed call epoch - 2 of this kind, which used this half.

    Returns 1 when it may be written, 0 when the wait ran out, -1 on an error (in status)."""
    before = epoch - 2
    ok = 1
    if _acquire(_done_word(table, me, kind, half, 0)) < before:
        _fail(status, E_MINE, me, before, 0, 0)
        ok = -1
    else:
        seen = _acquire(_done_word(table, peer, kind, half, 0))
        spins = _spent(status, max_spins)
        while (seen < before) & (spins < max_spins):
            seen = _acquire(_done_word(table, peer, kind, half, 0))
            spins += 1
        if seen < before:
            tl.atomic_xchg(status + WAITING_WORD, peer.to(tl.int64) + 1, sem="relaxed", scope="gpu")
            ok = 0
    return ok


@triton.jit
def _wait_stamp(table, status, me, peer, kind, header, half, stamp, epoch, max_spins):
    """Wait (bounded) for `peer`'s stamp (at address `stamp`) to read `epoch`: 1 landed, 0 the wait
    ran out (the peer is marked as awaited), -1 the peer rejected the call (an error)."""
    seen = _acquire(stamp)
    rejected = _acquire(_address(table, peer, REJECTED, 0) + kind * 8)
    spins = _spent(status, max_spins)
    while (seen != epoch) & (rejected < epoch) & (spins < max_spins):
        seen = _acquire(stamp)
        rejected = _acquire(_address(table, peer, REJECTED, 0) + kind * 8)
        spins += 1
    landed = 1
    if seen != epoch:
        landed = 0
        if rejected >= epoch:
            _fail(status, E_REJECTED, peer, 0, 0, 0)
            landed = -1
        else:
            tl.atomic_xchg(status + WAITING_WORD, peer.to(tl.int64) + 1, sem="relaxed", scope="gpu")
    return landed


@triton.jit
def _arrive_and_release(table, me, kind, half, epoch, arrivals, programs):
    """Every program of a receive half arrives once it is finished; the last one publishes
    "consumed" (the max of the epoch and a skipped call's), so peers may reuse this half."""
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals, 1, sem="acq_rel", scope="gpu")
    if arrived == programs - 1:
        skipped = _acquire(_done_word(table, me, kind, half, 1))
        _release(_done_word(table, me, kind, half, 0), tl.maximum(skipped, epoch))


# -- dispatch -------------------------------------------------------------------------------------


@triton.jit
def ll_dispatch_send_kernel(
    table, live, me, epochs, rows, topk, N, K, experts, L, code, T, Kmax, Tcap, slot_words,
    row_bytes, W, width, arrivals, progress, status, max_spins,
    WORD: tl.constexpr, NB: tl.constexpr, KB: tl.constexpr, WB: tl.constexpr,
):  # fmt: skip
    """Program (d, j): put every token that selected expert experts[d, j] into d's slots for
    (this rank, j), in token order, with token * Kmax + k beside it; the last of d's L programs
    stamps this rank's record in d (dtype, T, width, counts).

    rows [N, W] words, `width` bytes (this rank's tokens in wire form); topk int64 [N, K]; experts int64
    [R, L] the global id of each (rank, local expert); slot_words = row_bytes / word size;
    arrivals int64 [R], progress int64 [R, L] (1: sent) start zeroed for the call.
    """
    epoch, half = _epoch(epochs)
    d = tl.program_id(0)
    j = tl.program_id(1)
    go = (tl.load(live + d) != 0) & (tl.load(progress + d * L + j) == 0)
    if go:
        go = _wait_reusable(table, status, me, d, 0, half, epoch, max_spins) == 1
    if go:
        expert = tl.load(experts + d * L + j)
        slots = _address(table, d, SLOTS, half) + (me * L + j).to(tl.int64) * Tcap * row_bytes
        info = _words(_address(table, d, SLOT_INFO, half)) + (me * L + j).to(tl.int64) * Tcap
        ks = tl.arange(0, KB)
        count = tl.full((), 0, tl.int64)
        t0 = 0
        while t0 < N:
            tokens = t0 + tl.arange(0, NB)
            chosen = tl.load(
                topk + tokens[:, None] * K + ks[None, :],
                mask=(tokens[:, None] < N) & (ks[None, :] < K),
                other=-1,
            )
            match = chosen == expert
            hit = tl.sum(match.to(tl.int64), axis=1)  # 0 or 1: an expert appears once in a row
            k = tl.sum(tl.where(match, ks[None, :], 0), axis=1)
            pos = count + tl.cumsum(hit, axis=0) - 1
            tl.store(info + pos, tokens.to(tl.int64) * Kmax + k, mask=hit != 0)
            dst = slots.to(tl.pointer_type(WORD))
            c0 = 0
            while c0 < W:
                cols = c0 + tl.arange(0, WB)
                both = (hit[:, None] != 0) & (cols[None, :] < W)
                words = tl.load(rows + tokens[:, None].to(tl.int64) * W + cols[None, :], mask=both)
                tl.store(dst + pos[:, None] * slot_words + cols[None, :], words, mask=both)
                c0 += WB
            count += tl.sum(hit, axis=0)
            t0 += NB
        record = _words(_address(table, d, SENT, half)) + me * (S_COUNTS + L)
        tl.store(record + S_COUNTS + j, count)
        tl.store(progress + d * L + j, 1)
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals + d, 1, sem="acq_rel", scope="sys")
        if arrived == L - 1:  # the last of d's programs: every row for d is ordered before this
            tl.store(record + 1, code.to(tl.int64))
            tl.store(record + 2, T.to(tl.int64))
            tl.store(record + 3, width.to(tl.int64))
            tl.debug_barrier()
            _release(_address(table, d, SENT, half) + me * (S_COUNTS + L) * 8, epoch)


@triton.jit
def _check_sent(record, status, src, L, code, T, Tcap, row_bytes, width, dtype_lo, dtype_hi,
                LB: tl.constexpr):  # fmt: skip
    """`ll_halves.ll_dispatch_recv`'s checks of a landed record, in its order: 1 good, 0 failed."""
    dtype = tl.load(record + 1)
    their_T = tl.load(record + 2)
    their_width = tl.load(record + 3)
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
    return ok


@triton.jit
def ll_dispatch_recv_kernel(
    table, live, me, epochs, R, L, code, T, Kmax, Tcap, slot_words, row_bytes, width,
    dtype_lo, dtype_hi, plane0, W0, plane1, W1, M, src_token, src_rank, src_k, layout_range,
    recv_count, state, arrivals, status, max_spins,
    WORD: tl.constexpr, LB: tl.constexpr, IB: tl.constexpr, WB: tl.constexpr,
):  # fmt: skip
    """Program (j, src): place source src's rows for local expert j after the rows of the live
    sources before it (whose records it waits for too, to read their counts for j): plane0
    [L, M, W0] and plane1 [L, M, W1] words receive each row's first W0 and next W1 words (W1 = 0
    unless FP8: values, then scales); src_token, src_rank, src_k int64 [L, M], layout_range
    int64 [L, R, 2], recv_count int32 [L] (by program (j, R - 1)).

    state int64 [L, R] (zeroed for the call): 1 once the program finished, so that a launch after
    a wait ran out runs only the programs still waiting. The last program to finish releases
    the half.
    """
    epoch, half = _epoch(epochs)
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
                    before = tl.load(_words(stamp) + S_COUNTS + j)
                    if (before < 0) | (before > T):  # that source's own program reports it
                        go = tl.full((), 0, tl.int32)
                    else:
                        begin += before
            s += 1
        n = tl.full((), 0, tl.int64)
        if (go != 0) & (tl.load(live + src) != 0):
            stamp = _address(table, me, SENT, half) + src * (S_COUNTS + L) * 8
            if _check_sent(_words(stamp), status, src, L, code, T, Tcap, row_bytes, width,
                           dtype_lo, dtype_hi, LB) == 0:  # fmt: skip
                go = tl.full((), 0, tl.int32)
            else:
                n = tl.load(_words(stamp) + S_COUNTS + j)
                first = (src * L + j).to(tl.int64) * Tcap  # this source's slots for j
                info = _words(_address(table, me, SLOT_INFO, half)) + first
                slots = (_address(table, me, SLOTS, half) + first * row_bytes).to(tl.pointer_type(WORD))
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
                        c0 = 0
                        while c0 < W0:
                            cols = c0 + tl.arange(0, WB)
                            both = m[:, None] & (cols[None, :] < W0)
                            words = tl.load(held + cols[None, :], mask=both)
                            tl.store(plane0 + row[:, None] * W0 + cols[None, :], words, mask=both)
                            c0 += WB
                        c1 = 0
                        while c1 < W1:
                            cols = c1 + tl.arange(0, WB)
                            both = m[:, None] & (cols[None, :] < W1)
                            words = tl.load(held + W0 + cols[None, :], mask=both)
                            tl.store(plane1 + row[:, None] * W1 + cols[None, :], words, mask=both)
                            c1 += WB
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
def ll_combine_send_kernel(
    table, live, me, epochs, x, L, M, W, layout_range, R, per_writer, slot_words,
    code, arrivals, progress, status, max_spins,
    WORD: tl.constexpr, LB: tl.constexpr, IB: tl.constexpr, WB: tl.constexpr,
):  # fmt: skip
    """Program (h, j): put each row of local expert j in x [L, M, W] words that came from home h
    (the dispatch's layout_range [L, R, 2]) into this rank's run of h's back slots (from
    me * per_writer, ordered by local expert, then token: after the rows of experts < j); the
    last of h's L programs stamps this rank's record in h (dtype, rows sent). arrivals int64 [R]
    and progress int64 [R, L] (1: sent) start zeroed for the call."""
    epoch, half = _epoch(epochs)
    h = tl.program_id(0)
    j = tl.program_id(1)
    go = (tl.load(live + h) != 0) & (tl.load(progress + h * L + j) == 0)
    if go:
        go = _wait_reusable(table, status, me, h, 1, half, epoch, max_spins) == 1
    if go:
        back = _address(table, h, BACK_SLOTS, half).to(tl.pointer_type(WORD))
        begin = tl.load(layout_range + (j * R + h) * 2)
        n = tl.load(layout_range + (j * R + h) * 2 + 1)
        ls = tl.arange(0, LB)
        before = tl.sum(tl.load(layout_range + (ls * R + h) * 2 + 1, mask=ls < j, other=0), axis=0)
        i0 = 0
        while i0 < n:
            ii = i0 + tl.arange(0, IB)
            m = ii < n
            row = j * M + begin + ii
            slot = (me * per_writer + before + ii).to(tl.int64)
            c0 = 0
            while c0 < W:
                cols = c0 + tl.arange(0, WB)
                both = m[:, None] & (cols[None, :] < W)
                words = tl.load(x + row[:, None] * W + cols[None, :], mask=both)
                tl.store(back + slot[:, None] * slot_words + cols[None, :], words, mask=both)
                c0 += WB
            i0 += IB
        tl.store(progress + h * L + j, 1)
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals + h, 1, sem="acq_rel", scope="sys")
        if arrived == L - 1:  # the last of h's programs: every row for h is ordered before this
            ls = tl.arange(0, LB)
            counts = tl.load(layout_range + (ls * R + h) * 2 + 1, mask=ls < L, other=0)
            record = _words(_address(table, h, RETURNED, half)) + me * 3
            tl.store(record + 1, code.to(tl.int64))
            tl.store(record + 2, tl.sum(counts, axis=0))
            tl.debug_barrier()
            _release(_address(table, h, RETURNED, half) + me * 3 * 8, epoch)


@triton.jit
def ll_combine_recv_kernel(
    table, me, epochs, topk, K, owner, expected, weights, code, dtype_lo, dtype_hi, count_hi,
    slots, row_bytes, out, H, state, arrivals, programs, status, max_spins,
    Y_BF16: tl.constexpr, HB: tl.constexpr,
):  # fmt: skip
    """Program t (token): wait for the record of every rank holding one of t's experts, check it,
    then out[t] = sum over k ascending of weights[t, k] * y(t, k) where topk[t, k] >= 0, in float32
    (no fused multiply-add), stored as float32 or bf16 bits (int16).

    owner int64 [E]: rank of each expert; expected int64 [R]: rows this rank expects from each
    rank; slots int64 [N, K]: the back slot of each y(t, k) (`LLDevice.return_slots`); state int64
    [N] (zeroed for the call): 1 once t is finished (a second launch skips it).
    """
    epoch, half = _epoch(epochs)
    t = tl.program_id(0)
    if tl.load(state + t) == 0:
        go = tl.full((), 1, tl.int32)
        waiting = tl.full((), 0, tl.int32)
        k = 0
        while (go != 0) & (k < K):
            e = tl.load(topk + t * K + k)
            if e >= 0:
                r = tl.load(owner + e)
                stamp = _address(table, me, RETURNED, half) + r * 3 * 8
                landed = _wait_stamp(table, status, me, r, 1, RETURNED, half, stamp, epoch, max_spins)
                if landed != 1:
                    go = tl.full((), 0, tl.int32)
                    waiting = tl.full((), 1, tl.int32) * (landed == 0)
                else:
                    dtype = tl.load(_words(stamp) + 1)
                    count = tl.load(_words(stamp) + 2)
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
            while c0 < H:
                cols = c0 + tl.arange(0, HB)
                m = cols < H
                acc = tl.zeros((HB,), tl.float32)
                k = 0
                while k < K:
                    if tl.load(topk + t * K + k) >= 0:
                        w = tl.load(weights + t * K + k)
                        slot = back + tl.load(slots + t * K + k) * row_bytes
                        if Y_BF16:
                            y = tl.load(slot.to(tl.pointer_type(tl.bfloat16)) + cols, mask=m, other=0.0)
                        else:
                            y = tl.load(slot.to(tl.pointer_type(tl.float32)) + cols, mask=m, other=0.0)
                        acc = acc + y.to(tl.float32) * w
                    k += 1
                if Y_BF16:
                    tl.store(out + t.to(tl.int64) * H + cols, _bf16_bits(acc), mask=m)
                else:
                    tl.store(out + t.to(tl.int64) * H + cols, acc, mask=m)
                c0 += HB
        if waiting == 0:
            tl.store(state + t, 1)
            _arrive_and_release(table, me, 1, half, epoch, arrivals, programs)

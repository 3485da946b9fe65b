"""The UBEP protocol's dispatch halves as Triton kernels: each half one launch over the Buffer's
address table.

    protocol (ubep: blocks, order, status words) -> [these kernels] -> memory (address table)

The same halves as `ubep.protocols.ubep.numba_halves` (numba), over the same memory,
word for word (`ubep.protocols.ubep.blocks`): the table (int64 [R, 7, 2]) holds the
address of every block of `UbepBlocks.table()` in every rank's memory for both
halves; headers are records of int64 words, stamp first (route: num_tokens,
dtype, topk, counts[R]); rows are packed at their own width
(row t of X at t * b bytes, b = H * itemsize), top-k and weights at stride
max_topk. So a Triton rank and a numba rank could share a call. On a GPU the
addresses are the CUDA heap's device addresses, under Triton's interpreter the
shared-memory heap's host addresses.

    dispatch send   (R + token blocks programs): own top-k checked, lists (and the layout from
                    top-k), rows; the last program stamps ROUTE, then DATA
    dispatch routes (1 program): waits for every live route stamp, checks them, counts and prefix
    dispatch gather ((source, row block) programs): localizes the listed rows' top-k, waits for
                    the source's DATA stamp, copies its rows straight from its memory

The combine is normal mode's (`ubep.protocols.combine.triton_halves`), as are the
status and waiting helpers.

Ordering (docs/device.md has the argument): a program's rows and header words
are plain stores, then a block barrier, then a system-scope release (an arrival
whose last arriver, having acquired every other arrival, stamps with a
system-scope release); a reader polls a stamp with a system-scope acquire in the
program that then reads what it covers. Buffer reuse is UBEP's own argument
(`ubep.protocols.ubep.exchange`): call e + 2 of a kind is launched on a stream after this
rank's receive halves of e + 1, which needed every peer's e + 1 stamps, which
each peer's stream issued after its receive halves of e.

Every poll is bounded by `max_spins`: a program that runs out marks the peer it
waits for in status[WAITING_WORD] (1 + its rank) and stops; the host may launch
the half again (finished programs skip, through `state`) or report a timeout.
No host reads: every count, position and check is computed in the kernels.

The call's epoch is read from a device word (`epochs`, int64 [1]): the host's,
or one a graph advances, so a captured graph's replays are successive calls.

Status words (int64 [8]): [0] DONE or an error code of `ubep.protocols.ubep.codes`
(claimed by the first program that fails, which then writes [1:6] = peer, what
it sent, ..., expected, as the numba halves), [6] 1 + a peer some program still
waits for (0: none).

Legend: see `ubep.layout`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ubep.engine.triton_route import rank_hits
from ubep.engine.triton_sync import int64_ptr, load_acquire, load_epoch, store_release
from ubep.protocols.combine.triton_halves import await_stamp, copy_words, fail, own_topk_ok
from ubep.protocols.ubep import blocks, codes

# The places of `ubep.protocols.ubep.blocks` and the codes of `ubep.protocols.ubep.codes`, as Triton
# constants.
BLOCKS: tl.constexpr = tl.constexpr(len(blocks.TABLE))
ROUTE: tl.constexpr = tl.constexpr(blocks.ROUTE)
DATA: tl.constexpr = tl.constexpr(blocks.DATA)
TOPK: tl.constexpr = tl.constexpr(blocks.TOPK)
WEIGHTS: tl.constexpr = tl.constexpr(blocks.WEIGHTS)
LISTS: tl.constexpr = tl.constexpr(blocks.LISTS)
X: tl.constexpr = tl.constexpr(blocks.X)
SCALES: tl.constexpr = tl.constexpr(blocks.SCALES)
R_NUM: tl.constexpr = tl.constexpr(blocks.R_NUM)
R_DTYPE: tl.constexpr = tl.constexpr(blocks.R_DTYPE)
R_TOPK: tl.constexpr = tl.constexpr(blocks.R_TOPK)
R_COUNTS: tl.constexpr = tl.constexpr(blocks.R_COUNTS)

WAITING_WORD: tl.constexpr = tl.constexpr(codes.WAITING_WORD)  # status[6]: 1 + the peer still awaited
E_FIELD: tl.constexpr = tl.constexpr(codes.E_FIELD)
E_DTYPE: tl.constexpr = tl.constexpr(codes.E_DTYPE)
E_TOPK: tl.constexpr = tl.constexpr(codes.E_TOPK)
E_LIST: tl.constexpr = tl.constexpr(codes.E_LIST)
E_EXPERT: tl.constexpr = tl.constexpr(codes.E_EXPERT)
E_NONE_LOCAL: tl.constexpr = tl.constexpr(codes.E_NONE_LOCAL)
E_COUNT: tl.constexpr = tl.constexpr(codes.E_COUNT)
E_SHORT: tl.constexpr = tl.constexpr(codes.E_SHORT)
E_WORST: tl.constexpr = tl.constexpr(codes.E_WORST)
E_REJECTED: tl.constexpr = tl.constexpr(codes.E_REJECTED)
REJECTED: tl.constexpr = tl.constexpr(codes.REJECTED)


@triton.jit
def _address(table, rank, block, half):
    """Address (int64) of `block` in `rank`'s memory for this half."""
    return tl.load(table + (rank * BLOCKS + block) * 2 + half)


# -- dispatch -------------------------------------------------------------------------------------


@triton.jit
def ubep_dispatch_send_kernel(
    table, me, epochs, x, W, scales, S, topk, weights, N, K, in_rank, counts, owner, E, R, announced, code,
    Kmax, T, arrivals, programs, status,
    WORD: tl.constexpr, NB: tl.constexpr, KB: tl.constexpr, RB: tl.constexpr, WB: tl.constexpr,
    ROUTED: tl.constexpr,
):  # fmt: skip
    """Routing role, then token role, of one dispatch: everything this rank publishes, in its own memory.

    Program r < R: the ascending list of tokens for destination r (in_rank uint8 [N, R]). Program
    R + i: token block i's top-k (int64 [N, K]) and weights (float32 [N, K]) at stride Kmax, its rows
    (x [N, W] words) and FP8 scales (scales [N, S] int32 words, S = 0 unless FP8). Every program
    arrives on `arrivals` (int64 [1], zeroed for the call); the last writes the route header
    (announced, code, K, counts int64 [R]) and stamps ROUTE, then DATA.

    ROUTED: the routing is topk alone, and in_rank and counts are outputs. Every program first checks
    topk's values (`triton_route.first_bad_topk`); program r then derives column r of in_rank and
    counts[r] from topk and owner (int64 [E], each expert's rank). A bad value fails the call
    (status int64 [8]: E_OWN_EXPERT or E_OWN_REPEATED) before anything is published: the route
    header then says REJECTED, so that the peers stop instead of waiting. Otherwise in_rank and
    counts are inputs (a cached dispatch: the handle's).
    """
    epoch, half = load_epoch(epochs)
    pid = tl.program_id(0)
    go = tl.full((), 1, tl.int32)
    if ROUTED:
        go = own_topk_ok(topk, N, K, E, status, me, NB, KB)
    if (go != 0) & (pid < R):
        listed = int64_ptr(_address(table, me, LISTS, half)) + pid * T
        at = tl.full((), 0, tl.int64)
        t0 = 0
        while t0 < N:
            tokens = t0 + tl.arange(0, NB)
            if ROUTED:
                hit = rank_hits(topk, owner, tokens, N, K, E, pid, KB)
                tl.store(in_rank + tokens * R + pid, hit.to(tl.uint8), mask=tokens < N)
            else:
                hit = tl.load(in_rank + tokens * R + pid, mask=tokens < N, other=0).to(tl.int64)
            pos = at + tl.cumsum(hit, axis=0) - 1
            tl.store(listed + pos, tokens.to(tl.int64), mask=hit != 0)
            at += tl.sum(hit, axis=0)
            t0 += NB
        if ROUTED:
            tl.store(counts + pid, at)
    elif go != 0:
        tokens = (pid - R) * NB + tl.arange(0, NB)
        ok = tokens < N
        rows = tokens.to(tl.int64)
        if K > 0:
            ks = tl.arange(0, KB)
            both = ok[:, None] & (ks[None, :] < K)
            idx = tl.load(topk + rows[:, None] * K + ks[None, :], mask=both)
            w = tl.load(weights + rows[:, None] * K + ks[None, :], mask=both)
            own_idx = int64_ptr(_address(table, me, TOPK, half))
            own_w = _address(table, me, WEIGHTS, half).to(tl.pointer_type(tl.float32))
            tl.store(own_idx + rows[:, None] * Kmax + ks[None, :], idx, mask=both)
            tl.store(own_w + rows[:, None] * Kmax + ks[None, :], w, mask=both)
        own_x = _address(table, me, X, half).to(tl.pointer_type(WORD))
        copy_words(x, own_x, rows, rows, ok, W, WB)
        own_s = _address(table, me, SCALES, half).to(tl.pointer_type(tl.int32))
        copy_words(scales, own_s, rows, rows, ok, S, WB)
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals, 1, sem="acq_rel", scope="sys")
    if arrived == programs - 1:  # the last program: every list, count and row is ordered before this
        route = int64_ptr(_address(table, me, ROUTE, half))
        if go == 0:  # every program found the same bad value: the header says the call is rejected
            tl.store(route + R_NUM, tl.full((), REJECTED, tl.int64))
        else:
            tl.store(route + R_NUM, announced)  # stored as int64, the pointer's type
            tl.store(route + R_DTYPE, code)
            if K > 0:
                tl.store(route + R_TOPK, K)
            rs = tl.arange(0, RB)
            tl.store(route + R_COUNTS + rs, tl.load(counts + rs, mask=rs < R), mask=rs < R)
        tl.debug_barrier()
        store_release(_address(table, me, ROUTE, half), epoch)  # routing and counts are visible
        if go != 0:
            store_release(_address(table, me, DATA, half), epoch)  # the payload is visible


@triton.jit
def ubep_dispatch_routes_kernel(
    table, live, me, epochs, R, code, K, Kmax, T, dtype_lo, dtype_hi, counts, sent, prefix, worst,
    state, status, max_spins,
    CACHED: tl.constexpr, RB: tl.constexpr,
):  # fmt: skip
    """Wait for every live source's route header, check it as the numba `dispatch_routes` does (in
    its order), and take its count for this rank: counts and sent int64 [R] (0 for masked sources);
    unless CACHED, prefix int64 [R + 1] (rows from source s are [prefix[s], prefix[s + 1])), and with
    worst > 0 the total must fit in `worst` rows. state int64 [R + 1] (zeroed for the call): state[s]
    once s's stamp landed, state[R] once the routing is checked (the gather's go-ahead)."""
    epoch, half = load_epoch(epochs)
    go = tl.full((), 1, tl.int32)
    p = tl.full((), 0, tl.int32)
    while (go != 0) & (p < R):
        if (tl.load(live + p) != 0) & (tl.load(state + p) == 0):
            stamp = _address(table, p, ROUTE, half)
            if await_stamp(stamp, epoch, status, p, max_spins) == 0:
                go = tl.full((), 0, tl.int32)
            else:
                tl.store(state + p, 1)
        p += 1
    rs = tl.arange(0, RB)
    dtypes = tl.zeros((RB,), tl.int64)  # each live source's header words, loaded once: checked, then used
    topks = tl.zeros((RB,), tl.int64)
    p = tl.full((), 0, tl.int32)
    while (go != 0) & (p < R):  # bounds, field by field in declaration order
        count = tl.full((), 0, tl.int64)
        num = tl.full((), 0, tl.int64)
        if tl.load(live + p) != 0:
            words = int64_ptr(_address(table, p, ROUTE, half))
            num = tl.load(words + R_NUM)
            dtype = tl.load(words + R_DTYPE)
            topk = tl.load(words + R_TOPK)
            theirs = tl.load(words + R_COUNTS + rs, mask=rs < R, other=0)
            dtypes = tl.where(rs == p, dtype, dtypes)
            topks = tl.where(rs == p, topk, topks)
            count = tl.sum(tl.where(rs == me, theirs, 0), axis=0)
            bad = (rs < R) & ((theirs < 0) | (theirs > T))
            first_bad = tl.min(tl.where(bad, rs, RB), axis=0)
            bad_count = tl.sum(tl.where(rs == first_bad, theirs, 0), axis=0)
            if num == REJECTED:
                fail(status, E_REJECTED, p, 0, 0, 0, 0)
                go = tl.full((), 0, tl.int32)
            elif (num < 0) | (num > T):
                fail(status, E_FIELD, p, num, 0, 0, 0)
                go = tl.full((), 0, tl.int32)
            elif (dtype < dtype_lo) | (dtype > dtype_hi):
                fail(status, E_FIELD, p, dtype, 1, 0, 0)
                go = tl.full((), 0, tl.int32)
            elif (topk < 0) | (topk > Kmax):
                fail(status, E_FIELD, p, topk, 2, 0, 0)
                go = tl.full((), 0, tl.int32)
            elif first_bad < RB:
                fail(status, E_FIELD, p, bad_count, 3, 0, 0)
                go = tl.full((), 0, tl.int32)
        tl.store(counts + p, count)  # the loaded copies (a failed call uses none of them)
        tl.store(sent + p, num)
        p += 1
    p = tl.full((), 0, tl.int32)
    while (go != 0) & (p < R):
        if tl.load(live + p) != 0:
            dtype = tl.sum(tl.where(rs == p, dtypes, 0), axis=0)
            if dtype != code:
                fail(status, E_DTYPE, p, dtype, 0, 0, 0)
                go = tl.full((), 0, tl.int32)
        p += 1
    p = tl.full((), 0, tl.int32)
    while (go != 0) & (p < R):
        if tl.load(live + p) != 0:
            their_k = tl.sum(tl.where(rs == p, topks, 0), axis=0)
            if (K > 0) & (their_k != K):
                fail(status, E_TOPK, p, their_k, 0, 0, 0)
                go = tl.full((), 0, tl.int32)
        p += 1
    if go != 0:
        total = tl.full((), 0, tl.int64)
        p = tl.full((), 0, tl.int32)
        while p < R:
            if not CACHED:
                tl.store(prefix + p, total)
            total += tl.load(counts + p)
            p += 1
        if not CACHED:
            tl.store(prefix + R, total)
        if (worst > 0) & (total > worst):
            fail(status, E_WORST, -1, total, worst, 0, 0)
        else:
            tl.store(state + R, 1)


@triton.jit
def ubep_dispatch_gather_kernel(
    table, live, me, epochs, R, T, Kmax, E, routes, counts, sent, prefix, local_of_expert, K,
    recv_idx, recv_w, src_token, src_rank, recv_x, W, recv_scales, S, state, blocks, status, max_spins,
    WORD: tl.constexpr, IB: tl.constexpr, KB: tl.constexpr, WB: tl.constexpr,
):  # fmt: skip
    """Program (source p, row block i): p's rows [i * IB, (i + 1) * IB) for this rank, as
    `ubep_halves.dispatch_gather` places them: first their routing (K > 0: the listed tokens, their
    local top-k recv_idx int64 [M, K] and weights recv_w float32 [M, K], src_token and src_rank int64
    [M]; K = 0, a cached dispatch: src_token from the handle, checked), then, once p's DATA stamp
    landed, its rows (recv_x [M, W] words) and FP8 scales (recv_scales [M, S] int32 words) straight
    from p's memory. routes: the routes half's state (routes[R] 0: it failed or ran out, nothing
    to do); state int64 [R, blocks] (zeroed for the call): 1 once the block is placed."""
    epoch, half = load_epoch(epochs)
    p = tl.program_id(0)
    i = tl.program_id(1)
    first = i * IB
    count = tl.load(counts + p)
    go = tl.full((), 0, tl.int32)
    if (tl.load(routes + R) != 0) & (tl.load(live + p) != 0) & (tl.load(state + p * blocks + i) == 0):
        if (first < count) & (tl.load(status) == 0):
            go = tl.full((), 1, tl.int32)
    if go != 0:
        a = tl.load(prefix + p)
        n = tl.load(sent + p)
        ii = first + tl.arange(0, IB)
        ok = ii < count
        rows = a + ii
        if K > 0:
            load_acquire(_address(table, p, ROUTE, half))  # landed (the routes half saw it): order the reads
            listed = tl.load(int64_ptr(_address(table, p, LISTS, half)) + me * T + ii, mask=ok, other=0)
            if tl.sum((ok & ((listed < 0) | (listed >= n))).to(tl.int32), axis=0) > 0:
                fail(status, E_LIST, p, n, 0, 0, 0)
                go = tl.full((), 0, tl.int32)
            else:
                ks = tl.arange(0, KB)
                both = ok[:, None] & (ks[None, :] < K)
                theirs = int64_ptr(_address(table, p, TOPK, half))
                their_w = _address(table, p, WEIGHTS, half).to(tl.pointer_type(tl.float32))
                e = tl.load(theirs + listed[:, None] * Kmax + ks[None, :], mask=both, other=-1)
                w = tl.load(their_w + listed[:, None] * Kmax + ks[None, :], mask=both, other=0.0)
                if tl.sum(tl.sum((both & ((e < -1) | (e >= E))).to(tl.int32), axis=1), axis=0) > 0:
                    fail(status, E_EXPERT, p, E, 0, 0, 0)
                    go = tl.full((), 0, tl.int32)
                else:
                    local = tl.load(local_of_expert + e, mask=both & (e >= 0), other=-1)
                    mine = tl.sum((local >= 0).to(tl.int32), axis=1)
                    if tl.sum((ok & (mine == 0)).to(tl.int32), axis=0) > 0:
                        fail(status, E_NONE_LOCAL, p, 0, 0, 0, 0)
                        go = tl.full((), 0, tl.int32)
                    else:
                        tl.store(recv_idx + rows[:, None] * K + ks[None, :], local, mask=both)
                        tl.store(recv_w + rows[:, None] * K + ks[None, :], tl.where(local >= 0, w, 0.0),
                                 mask=both)  # fmt: skip
                        tl.store(src_token + rows, listed, mask=ok)
                        tl.store(src_rank + rows, tl.zeros((IB,), tl.int64) + p, mask=ok)
        else:  # cached: the handle's rows must be what p sends, from tokens it has
            expected = tl.load(prefix + p + 1) - a
            listed = tl.load(src_token + rows, mask=ok, other=0)
            if count != expected:
                fail(status, E_COUNT, p, count, expected, 0, 0)
                go = tl.full((), 0, tl.int32)
            elif tl.sum((ok & ((listed < 0) | (listed >= n))).to(tl.int32), axis=0) > 0:
                fail(status, E_SHORT, p, n, 0, 0, 0)
                go = tl.full((), 0, tl.int32)
        if go != 0:
            if await_stamp(_address(table, p, DATA, half), epoch, status, p, max_spins) == 1:
                their_x = _address(table, p, X, half).to(tl.pointer_type(WORD))
                copy_words(their_x, recv_x, listed, rows, ok, W, WB)
                their_s = _address(table, p, SCALES, half).to(tl.pointer_type(tl.int32))
                copy_words(their_s, recv_scales, listed, rows, ok, S, WB)
                tl.store(state + p * blocks + i, 1)

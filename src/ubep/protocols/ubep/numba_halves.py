"""The UBEP protocol's dispatch halves, each one compiled function over the Buffer's address table.

    protocol (ubep: blocks, order, status words) -> [these halves] -> memory (address table)

Each half moves its rows and synchronises through them (data as flag) in one
call, GIL released. The protocol's statement in torch is
`ubep.protocols.ubep.exchange`; these halves keep its memory layout word for
word (`ubep.protocols.ubep.blocks`: the same regions, the same header records),
so the two agree bit for bit and could even share a call. The combine is normal
mode's (`ubep.protocols.combine.numba_halves`), as are the waiting helpers.

The address table (`table`, int64 [R, 7, 2]) holds the address of every block
of `UbepBlocks.table()` in every rank's memory, for both halves of the double
buffer; `asleep` (int64 [R]) the address of each rank's ASLEEP word. Both are
built once, when the Buffer is (`Heap.address_table`).

Headers are records of int64 words: word 0 is the stamp (the call's epoch),
stored last with release ordering and polled with acquire ordering; the fields
follow in declaration order (route: num_tokens, dtype, topk, counts[R]).

Waiting (`await_stamps`): spin, yield, arm the ASLEEP word, then return WAITING
for Python to sleep on the doorbell and enter again; the half resumes where it
stopped (`state`).

Every value read from a peer is checked against its bounds before use; a bad
one ends the half with an error status naming the peer, the value and what it
broke (`status`: code, peer, value, extra), which the protocol turns into the
exception and words of docs/reliability.md.

Example (R = 2, rank 1, counts [2, 0 | 1, 3]): dispatch_routes finds route
stamps of ranks 0 and 1, takes column 1 of each count row (0 and 3): prefix
[0, 0, 3]; dispatch_gather copies rank 1's three listed rows into recv rows
0..2 once its data stamp lands.

Legend: see `ubep.layout`.
"""

from __future__ import annotations

import numpy as np

from ubep.engine.numba_kernels import _elements_at, _jit, _move, words_once
from ubep.engine.numba_sync import load_acquire
from ubep.protocols.combine.numba_halves import await_stamps, fail, publish
from ubep.protocols.ubep.blocks import (
    DATA,
    LISTS,
    R_COUNTS,
    R_DTYPE,
    R_NUM,
    R_TOPK,
    ROUTE,
    SCALES,
    TOPK,
    WEIGHTS,
    X,
)
from ubep.protocols.ubep.codes import (
    DONE,
    E_COUNT,
    E_DTYPE,
    E_EXPERT,
    E_FIELD,
    E_LIST,
    E_NONE_LOCAL,
    E_REJECTED,
    E_SHORT,
    E_TOPK,
    REJECTED,
    WAITING,
)

_I64, _F32 = np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float32)  # element types for raw views


# -- dispatch ---------------------------------------------------------------------------------------


@_jit
def dispatch_send(
    table, asleep, me, epoch, half, live,
    x_rows, scales, topk, weights, in_rank, counts, announced, dtype_code, Kmax, T, wake,
):  # fmt: skip
    """Routing role, then token role, of one dispatch: everything this rank publishes.

    topk [N, K] int64 and weights [N, K] float32 (K = 0: a cached dispatch);
    in_rank uint8 [N, R] and counts int64 [R], the layout; x_rows uint8 [N, b]
    (this rank's rows as bytes), scales float32 [N, S] (S = 0 unless FP8).
    Returns how many peers to ring (marked in `wake`).
    """
    N, K, R = x_rows.shape[0], topk.shape[1], counts.size
    own = table[me]
    if K:  # own routing, global expert ids, at full width Kmax per row
        for t in range(N):
            idx = _elements_at(_I64, own[TOPK, half] + t * Kmax * 8, K)
            w = _elements_at(_F32, own[WEIGHTS, half] + t * Kmax * 4, K)
            for k in range(K):
                idx[k] = topk[t, k]
                w[k] = weights[t, k]
    at = np.zeros(R, dtype=np.int64)  # next free place in each destination's list
    for t in range(N):
        for r in range(R):
            if in_rank[t, r]:
                list_r = _elements_at(_I64, own[LISTS, half] + (r * T + at[r]) * 8, 1)
                list_r[0] = t
                at[r] += 1
    route = _elements_at(_I64, own[ROUTE, half], R_COUNTS + R)
    route[R_NUM], route[R_DTYPE] = announced, dtype_code
    if K:
        route[R_TOPK] = K
    for r in range(R):
        route[R_COUNTS + r] = counts[r]
    woken = publish(own[ROUTE, half], epoch, asleep, live, me, wake)  # routing and counts are visible
    if N:
        _move(own[X, half], x_rows.ctypes.data, N * x_rows.shape[1])
        if scales.shape[1]:
            _move(own[SCALES, half], scales.ctypes.data, N * scales.shape[1] * 4)
    return woken + publish(own[DATA, half], epoch, asleep, live, me, wake)  # the payload is visible


@_jit
def dispatch_routes(
    table, asleep, me, epoch, half, live, dtype_code, K, Kmax, T, dtype_lo, dtype_hi,
    done, counts, sent, pending, spins, yields, status,
):  # fmt: skip
    """Wait for every live source's route header, check it, and take its count for this rank.

    K = 0 for a cached dispatch (no top-k to agree on). Fills counts [R] (rows
    from each source) and sent [R] (tokens each source announced); masked
    sources get 0. Returns DONE, WAITING (pending[:status[1]] still missing)
    or an error code (see `status`).
    """
    R = counts.size
    n = await_stamps(table, asleep, ROUTE, half, live, me, epoch, done, pending, spins, yields, True)
    if n:
        status[1] = n
        return WAITING
    for r in range(R):
        counts[r], sent[r] = 0, 0
    route_RW = np.zeros((R, R_COUNTS + R), dtype=np.int64)  # each live peer's header, copied once
    for p in live:
        route_RW[p] = words_once(table[p, ROUTE, half], R_COUNTS + R)
    for p in live:  # bounds, field by field in declaration order
        words = route_RW[p]
        if words[R_NUM] == REJECTED:  # a Triton sender that found its own input bad
            return fail(status, E_REJECTED, p, 0, 0, 0, 0)
        if not 0 <= words[R_NUM] <= T:
            return fail(status, E_FIELD, p, words[R_NUM], 0, 0, 0)
        if not dtype_lo <= words[R_DTYPE] <= dtype_hi:
            return fail(status, E_FIELD, p, words[R_DTYPE], 1, 0, 0)
        if not 0 <= words[R_TOPK] <= Kmax:
            return fail(status, E_FIELD, p, words[R_TOPK], 2, 0, 0)
        for r in range(R):
            if not 0 <= words[R_COUNTS + r] <= T:
                return fail(status, E_FIELD, p, words[R_COUNTS + r], 3, 0, 0)
        counts[p], sent[p] = words[R_COUNTS + me], words[R_NUM]
    for p in live:
        if route_RW[p, R_DTYPE] != dtype_code:
            return fail(status, E_DTYPE, p, route_RW[p, R_DTYPE], 0, 0, 0)
    for p in live:
        if K and route_RW[p, R_TOPK] != K:
            return fail(status, E_TOPK, p, route_RW[p, R_TOPK], 0, 0, 0)
    return DONE


@_jit
def _localize(
    table, half, live, me, prefix, counts, sent, T, Kmax, local_of_expert, recv_idx, recv_w, src_token,
    src_rank, per_expert, status,
):  # fmt: skip
    """Every source's list for this rank and the local top-k of the listed rows (routing has landed);
    each row's source rank, and the rows each local expert gets (per_expert [L])."""
    M, K = recv_idx.shape
    E = local_of_expert.size
    per_expert[:] = 0
    for p in live:
        a = prefix[p]
        listed = _elements_at(_I64, table[p, LISTS, half] + me * T * 8, counts[p])
        for i in range(counts[p]):
            t = listed[i]
            if t < 0 or t >= sent[p]:
                return fail(status, E_LIST, p, sent[p], 0, 0, 0)
            src_token[a + i], src_rank[a + i] = t, p
            idx = _elements_at(_I64, table[p, TOPK, half] + t * Kmax * 8, K)
            w = _elements_at(_F32, table[p, WEIGHTS, half] + t * Kmax * 4, K)
            mine = 0
            for k in range(K):
                e = idx[k]
                if e < -1 or e >= E:
                    return fail(status, E_EXPERT, p, E, 0, 0, 0)
                local = local_of_expert[e] if e >= 0 else -1
                recv_idx[a + i, k] = local
                recv_w[a + i, k] = w[k] if local >= 0 else np.float32(0.0)
                if local >= 0:
                    per_expert[local] += 1
                    mine += 1
            if mine == 0:
                return fail(status, E_NONE_LOCAL, p, 0, 0, 0, 0)
    return DONE


@_jit
def _check_cached(live, prefix, counts, sent, src_token, status):
    """A cached dispatch's sources must send the rows its handle expects, from tokens they have."""
    for p in live:
        a, z = prefix[p], prefix[p + 1]
        if counts[p] != z - a:
            return fail(status, E_COUNT, p, counts[p], z - a, 0, 0)
        for i in range(a, z):
            if src_token[i] < 0 or src_token[i] >= sent[p]:
                return fail(status, E_SHORT, p, sent[p], 0, 0, 0)
    return DONE


@_jit
def dispatch_gather(
    table, asleep, me, epoch, half, live, prefix, counts, sent, T, Kmax, local_of_expert,
    recv_idx, recv_w, src_token, src_rank, per_expert, recv_x, recv_scales, state, pending, spins, yields,
    status,
):  # fmt: skip
    """Place every source's rows as its payload lands: first the local top-k of all (or, cached,
    the handle's rows checked), then each landed source's rows, gathered straight from its memory.

    recv_idx [M, K] / recv_w [M, K] (K = 0: cached, src_token then comes from the
    handle), src_rank [M] and per_expert [L] filled with them; recv_x uint8 [M, b];
    recv_scales float32 [M, S]. state int64 [R + 1]:
    state[0] set once the routing is placed, state[1 + s] once source s's rows are.
    """
    if state[0] == 0:
        if recv_idx.shape[1]:
            code = _localize(
                table, half, live, me, prefix, counts, sent, T, Kmax, local_of_expert, recv_idx, recv_w,
                src_token, src_rank, per_expert, status,
            )  # fmt: skip
        else:
            code = _check_cached(live, prefix, counts, sent, src_token, status)
        if code != DONE:
            return code
        state[0] = 1
    done = state[1:]
    b, S = recv_x.shape[1], recv_scales.shape[1]
    out_at, scales_at = recv_x.ctypes.data, recv_scales.ctypes.data
    while True:
        n = await_stamps(table, asleep, DATA, half, live, me, epoch, done, pending, spins, yields, False)
        moved = False
        for p in live:
            if done[p] or load_acquire(table[p, DATA, half]) != epoch:
                continue
            x_at, s_at = table[p, X, half], table[p, SCALES, half]
            for i in range(prefix[p], prefix[p + 1]):
                t = src_token[i]
                _move(out_at + i * b, x_at + t * b, b)
                if S:
                    _move(scales_at + i * S * 4, s_at + t * S * 4, S * 4)
            done[p] = 1
            moved = True
        placed = 0
        for p in live:  # done, not merely landed: a source may land after the loop passed it
            placed += done[p]
        if placed == live.size:
            return DONE
        if not moved:  # the budget ran out with sources still missing: Python sleeps, then re-enters
            status[1] = n
            return WAITING

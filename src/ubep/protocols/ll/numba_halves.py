"""Low-latency mode's call halves, each one compiled function over the Buffer's address table.

    protocol (ll: slots, reuse words, status words) -> [these halves] -> memory (address table)

The statement in torch is `ubep.protocols.ll.exchange` (its docstring has the reuse
argument); these halves keep its memory layout word for word. The table
(int64 [R, 7, 2]) holds the address of every block of `LLBlocks.table()` in every
rank's memory for both halves; headers are inbox records (the owner's memory
holds one per writer: writer p's record at row p), stamp first, then the fields
(sent: dtype, T, width, counts[L]; returned: dtype, count).

As the Triton halves, the send halves take this rank's topk_idx (and in combine the
handle) and find every row's place themselves, after checking them (E_EXPERT, ...)
before their one wait (the reuse wait) and before any put: a call builds no plan on
the host.

Waiting is `ubep.protocols.ubep.numba_halves`'s: spin, yield, arm the ASLEEP word, then
return WAITING for Python to sleep on the doorbell and enter again; `state`
keeps the progress between entries (a send half re-entered checks its inputs
again and resumes its reuse wait: it puts nothing before that wait is over). A
peer whose stamp is missing while its `rejected` word for this kind has reached
the call's epoch rejected the call itself: E_REJECTED names it at once.

Example (R = 2, L = 1, T = 2, rank 0 sends token 1 with k = 0 to rank 1's expert):
ll_dispatch_send stages its rows in its own slots[0] (token 1 at row 1), writes info
1 * Kmax + 0 into rank 1's slot_info [0, 0, 0], then stamps its record in rank 1's
`sent` inbox, counts [1]; ll_dispatch_recv on rank 1 copies rank 0's staged row 1 to
recv_x[0, 0] with recv_src_token 1, recv_src_rank 0, recv_src_k 0.

Legend: see `ubep.protocols.ll.plans` (L local experts, P pairs, Q rows sent back).
"""

from __future__ import annotations

import numpy as np

from ubep.engine.numba_kernels import (
    BAD_EXPERT,
    CHUNK,
    OK,
    _elements_at,
    _id_range,
    _jit,
    _move,
    _routing_verdict,
    store,
    widen,
    words_once,
)
from ubep.engine.numba_sync import (
    ASLEEP_REUSE,
    back_off,
    load_acquire,
    masked_by,
    store_relaxed,
    store_release,
    wake_if_asleep,
    wake_reusers,
)
from ubep.protocols.ll.blocks import (
    BACK_SLOTS,
    COMBINE,
    CONSUMED,
    DISPATCH,
    DONE_WORDS,
    R_COUNT,
    R_DTYPE,
    REJECTED,
    RETURNED,
    RETURNED_FIELDS,
    S_COUNTS,
    S_DTYPE,
    S_T,
    S_WIDTH,
    SENT,
    SKIPPED,
    SLOT_INFO,
    SLOTS,
)
from ubep.protocols.ll.codes import (
    DONE,
    E_COUNTS,
    E_EXPERT,
    E_FIELD,
    E_FORMAT,
    E_LAYOUT,
    E_MINE,
    E_OTHER_TOPK,
    E_REJECTED,
    E_REPEATED,
    E_RETURNED,
    E_T,
    E_TOKENS,
    E_TOO_MANY,
    E_UNRECEIVED,
    WAITING,
)

MASKED = -1  # a send half found, after a block, that the peers masked this rank: it put no more

_I64 = np.empty(0, dtype=np.int64)
R_WORDS = 1 + len(RETURNED_FIELDS)  # a writer's row of the `returned` inbox: stamp, dtype, count


@_jit
def _done_word(table, rank, kind, half, word):
    """Address of rank's done[kind, half, word]."""
    return table[rank, DONE_WORDS, 0] + ((kind * 2 + half) * 2 + word) * 8


@_jit
def _fail(status, code, peer, a, b, c):
    """End a half with an error: status = (code, peer, what it sent, ..., expected)."""
    status[0], status[1], status[2], status[3], status[4] = code, peer, a, b, c
    return code


@_jit
def _not_reusable(table, live, me, kind, half, before, pending):
    """Live peers that have not consumed call `before` of this kind on this half yet."""
    n = 0
    for p in live:
        if p != me and load_acquire(_done_word(table, p, kind, half, CONSUMED)) < before:
            pending[n] = p
            n += 1
    return n


@_jit
def _reusable(table, asleep, me, live, kind, half, epoch, pending, spins, yields, status):
    """Wait until every live peer consumed call epoch - 2 of this kind (it used the same half):
    DONE, WAITING (status[1] peers in pending) or E_MINE (this rank's own receive half of that call
    has not run)."""
    before = epoch - 2
    if load_acquire(_done_word(table, me, kind, half, CONSUMED)) < before:
        return _fail(status, E_MINE, me, before, 0, 0)
    store_relaxed(asleep[me], 0)
    step = 0
    n = _not_reusable(table, live, me, kind, half, before, pending)
    while n and back_off(step, spins, yields, asleep, me, ASLEEP_REUSE):
        n = _not_reusable(table, live, me, kind, half, before, pending)
        step += 1
    if n:
        status[1] = n
        return WAITING
    store_relaxed(asleep[me], 0)
    return DONE


@_jit
def _own_topk(topk, num_experts, me, status):
    """This rank's topk_idx [N, K], checked as `ubep.validate.topk_idx` does: DONE, E_EXPERT (status[2]:
    the smallest id if one is below -1, else the largest) or E_REPEATED (status[4]: the first such row)."""
    found = np.zeros(1, dtype=np.int64)
    verdict = _routing_verdict(topk, num_experts, found)
    if verdict == OK:
        return DONE
    if verdict == BAD_EXPERT:
        return _fail(status, E_EXPERT, me, found[0], num_experts, 0)
    return _fail(status, E_REPEATED, me, 0, 0, found[0])


@_jit
def _landed(table, asleep, me, kind, half, epoch, header, words, peer, pending, spins, yields, status):
    """Wait for peer's record in this rank's `header` inbox: DONE, WAITING, or E_REJECTED."""
    stamp = table[me, header, half] + peer * words * 8
    store_relaxed(asleep[me], 0)
    step = 0
    while load_acquire(stamp) != epoch:
        if load_acquire(table[peer, REJECTED, 0] + kind * 8) >= epoch:
            return _fail(status, E_REJECTED, peer, 0, 0, 0)
        if not back_off(step, spins, yields, asleep, me):
            pending[0], status[1] = peer, 1
            return WAITING
        step += 1
    store_relaxed(asleep[me], 0)
    return DONE


@_jit
def _others_first(live, me, R):
    """The live ranks in the order of sends: the next ranks first, this rank last."""
    order = np.empty(live.size, dtype=np.int64)
    n = 0
    for j in range(1, R + 1):
        r = (me + j) % R
        for p in live:
            if p == r:
                order[n] = r
                n += 1
    return order


@_jit
def _consumed(table, asleep, me, live, kind, half, epoch, wake):
    """This rank read its last byte of the call's half: peers may reuse it (and those that sleep
    waiting to are woken)."""
    skipped = load_acquire(_done_word(table, me, kind, half, SKIPPED))
    store_release(_done_word(table, me, kind, half, CONSUMED), max(epoch, skipped))
    return wake_reusers(asleep, live, me, wake)


# -- dispatch ---------------------------------------------------------------------------------------


@_jit
def ll_dispatch_send(
    table, asleep, me, epoch, half, live, rows, topk, rank_of_expert, local_of_expert, code, T,
    Kmax, Tcap, row_bytes, wake, members, generation, pending, spins, yields, status,
):  # fmt: skip
    """Check this rank's topk_idx, wait until every peer consumed call e - 2, stage this rank's rows
    once in its own slots, then give each destination the (token, top-k slot) of every pair it
    receives and stamp this rank's record there.

    rows uint8 [N, b] (this rank's tokens in wire form) go to rows 0..N-1 of this rank's own
    slots[me] (`ubep.protocols.ll.exchange`: the staged form); topk int64 [N, K]. Each destination
    gets its pairs' infos by (local expert, token), their counts in the record. Before the first
    block and after each, the membership check (`masked_by`). Returns DONE (status[5]: destinations
    to ring, marked in `wake`), WAITING (the reuse wait), MASKED, or an error code before any write.
    """
    R, L = table.shape[0], rank_of_expert.size // table.shape[0]
    N, K = topk.shape
    b = rows.shape[1]
    words = S_COUNTS + L
    code_now = _own_topk(topk, rank_of_expert.size, me, status)
    if code_now == DONE:
        code_now = _reusable(table, asleep, me, live, DISPATCH, half, epoch, pending, spins, yields, status)
    if code_now != DONE:
        return code_now
    if masked_by(members, live, me, generation) >= 0:
        return MASKED
    staged = table[me, SLOTS, half] + me * L * Tcap * row_bytes  # this rank's own slots[me]
    if b == row_bytes:
        _move(staged, rows.ctypes.data, N * b)
    else:
        for t in range(N):
            _move(staged + t * row_bytes, rows.ctypes.data + t * b, b)
    counts_RL = np.zeros((R, L), dtype=np.int64)
    for t in range(N):
        for k in range(K):
            if topk[t, k] >= 0:
                counts_RL[rank_of_expert[topk[t, k]], local_of_expert[topk[t, k]]] += 1
    woken = 0
    placed = np.empty(L, dtype=np.int64)  # infos written so far for each local expert
    for dst in _others_first(live, me, R):
        info = _elements_at(_I64, table[dst, SLOT_INFO, half] + me * L * Tcap * 8, L * Tcap)
        placed[:] = 0
        for t in range(N):  # tokens ascending: each expert's run in token order
            for k in range(K):
                e = topk[t, k]
                if e >= 0 and rank_of_expert[e] == dst:
                    j = local_of_expert[e]
                    info[j * Tcap + placed[j]] = t * Kmax + k
                    placed[j] += 1
        record = _elements_at(_I64, table[dst, SENT, half] + me * words * 8, words)
        record[S_DTYPE], record[S_T], record[S_WIDTH] = code, T, b
        for j in range(L):
            record[S_COUNTS + j] = counts_RL[dst, j]
        store_release(table[dst, SENT, half] + me * words * 8, epoch)  # the rows and infos are visible
        if dst != me:
            woken += wake_if_asleep(asleep, dst, wake)
        if masked_by(members, live, me, generation) >= 0:
            return MASKED
    status[5] = woken
    return DONE


@_jit
def ll_dispatch_recv(
    table, asleep, me, epoch, half, live_R, code, T, Kmax, Tcap, row_bytes, dtype_lo, dtype_hi,
    plane0, plane1, src_token, src_rank, src_k, layout_range, recv_count, state, wake,
    members, generation, pending, spins, yields, status,
):  # fmt: skip
    """Place each source's rows, in ascending source order, as its record lands: each (token, top-k
    slot) of its infos here names a row it staged in its own slots[src], copied from there.

    plane0 uint8 [L, M, w0] and plane1 uint8 [L, M, w1] (w1 = 0 unless FP8: values,
    then scales) receive each row's first w0 and next w1 bytes; live_R uint8 [R] marks
    live ranks. state int64 [1 + L]: the next source, then the rows placed per expert.
    Returns DONE (recv_count set, the half released), WAITING, MASKED (the peers masked this
    rank meanwhile: what it read may not be whole; not released) or an error code.
    """
    L, M, w0 = plane0.shape
    w1 = plane1.shape[2]
    R = live_R.size
    words = S_COUNTS + L
    begin = state[1:]
    while state[0] < R:
        src = state[0]
        if not live_R[src]:  # masked: sends nothing
            for j in range(L):
                layout_range[j, src, 0], layout_range[j, src, 1] = begin[j], 0
            state[0] += 1
            continue
        code_now = _landed(
            table, asleep, me, 0, half, epoch, SENT, words, src, pending, spins, yields, status
        )
        if code_now != DONE:
            return code_now
        record = words_once(table[me, SENT, half] + src * words * 8, words)  # checked and used: this copy
        if not dtype_lo <= record[S_DTYPE] <= dtype_hi:
            return _fail(status, E_FIELD, src, record[S_DTYPE], 0, 0)
        if not 0 <= record[S_T] <= Tcap:
            return _fail(status, E_FIELD, src, record[S_T], 1, 0)
        if not 0 <= record[S_WIDTH] <= row_bytes:
            return _fail(status, E_FIELD, src, record[S_WIDTH], 2, 0)
        for j in range(L):
            if not 0 <= record[S_COUNTS + j] <= Tcap:
                return _fail(status, E_FIELD, src, record[S_COUNTS + j], 3, 0)
        if record[S_T] != T:
            return _fail(status, E_T, src, record[S_T], 0, 0)
        if record[S_DTYPE] != code or record[S_WIDTH] != w0 + w1:
            return _fail(status, E_FORMAT, src, 0, 0, 0)
        for j in range(L):
            if record[S_COUNTS + j] > T:
                return _fail(status, E_COUNTS, src, 0, 0, 0)
        info = _elements_at(_I64, table[me, SLOT_INFO, half] + src * L * Tcap * 8, L * Tcap)
        staged = table[src, SLOTS, half] + src * L * Tcap * row_bytes  # the source's rows, in its memory
        for j in range(L):  # each row's info read once: checked, then placed from the same value
            n = record[S_COUNTS + j]
            for i in range(n):
                slot_info = info[j * Tcap + i]
                if slot_info < 0 or slot_info // Kmax >= T:
                    return _fail(status, E_TOKENS, src, 0, 0, 0)
                row, pos = staged + (slot_info // Kmax) * row_bytes, begin[j] + i
                _move(plane0[j, pos].ctypes.data, row, w0)
                if w1:
                    _move(plane1[j, pos].ctypes.data, row + w0, w1)
                src_token[j, pos] = slot_info // Kmax
                src_k[j, pos] = slot_info % Kmax
                src_rank[j, pos] = src
        for j in range(L):
            n = record[S_COUNTS + j]
            layout_range[j, src, 0], layout_range[j, src, 1] = begin[j], n
            begin[j] += n
        state[0] += 1
    live = np.flatnonzero(live_R)
    if masked_by(members, live, me, generation) >= 0:  # what was read above was whole: this rank was live
        return MASKED
    for j in range(L):
        recv_count[j] = begin[j]
    status[5] = _consumed(table, asleep, me, live, 0, half, epoch, wake)  # to ring
    return DONE


# -- combine ----------------------------------------------------------------------------------------


@_jit
def _own_handle(recv_count, layout_range, topk, given, per_writer, M, me, status):
    """A combine's own inputs, as the Triton send kernel checks them: the handle's dispatch was received
    (recv_count [L] >= 0), its layout_range [L, R, 2] names rows inside [0, recv_count) <= M,
    topk_idx `given` [N, K] is the dispatch's `topk`, and no home sent more rows than its tokens can
    select here (per_writer). DONE or the error code."""
    L, R, _ = layout_range.shape
    for j in range(L):
        if recv_count[j] < 0:
            return _fail(status, E_UNRECEIVED, me, 0, 0, 0)
        if recv_count[j] > M:
            return _fail(status, E_LAYOUT, me, j, 0, 0)
    for t in range(given.shape[0]):
        for k in range(given.shape[1]):
            if given[t, k] != topk[t, k]:
                return _fail(status, E_OTHER_TOPK, me, 0, 0, t)
    for home in range(R):
        rows = 0
        for j in range(L):
            begin, n = layout_range[j, home, 0], layout_range[j, home, 1]
            if begin < 0 or n < 0 or begin + n > recv_count[j]:
                return _fail(status, E_LAYOUT, me, j, home, 0)
            rows += n
        if rows > per_writer:
            return _fail(status, E_TOO_MANY, home, rows, per_writer, 0)
    return DONE


@_jit
def ll_combine_send(
    table, asleep, me, epoch, half, live, x, layout_range, recv_count, topk, given, code, per_writer,
    row_bytes, wake, members, generation, first_home, last_home, pending, spins, yields, status,
):  # fmt: skip
    """Check the combine's own inputs (`_own_handle`), wait until every peer consumed call e - 2, then
    put the rows each home gets back into this rank's own run of its slots and stamp there.

    x uint8 [L, M, b] (contiguous): the rows of local expert j that came from `home` are
    layout_range[j, home] = (begin, count); they go to home's back slot me * per_writer
    onwards, ordered by (local expert, row). Homes in send order from first_home to last_home (a
    fault test splits the loop); before the first block and after each, the membership check.
    Returns DONE (status[5]: homes to ring), WAITING, MASKED, or an error code before any put.
    """
    R = table.shape[0]
    L, M, b = x.shape
    code_now = _own_handle(recv_count, layout_range, topk, given, per_writer, M, me, status)
    if code_now == DONE:
        code_now = _reusable(table, asleep, me, live, COMBINE, half, epoch, pending, spins, yields, status)
    if code_now != DONE:
        return code_now
    if masked_by(members, live, me, generation) >= 0:
        return MASKED
    woken = 0
    for home in _others_first(live, me, R)[first_home:last_home]:
        slot = table[home, BACK_SLOTS, half] + me * per_writer * row_bytes
        sent = 0
        for j in range(L):
            begin, n = layout_range[j, home, 0], layout_range[j, home, 1]
            if b == row_bytes:  # the rows are contiguous in x and in the slots: one move
                _move(slot, x.ctypes.data + (j * M + begin) * b, n * b)
                slot += n * b
            else:
                for i in range(begin, begin + n):
                    _move(slot, x.ctypes.data + (j * M + i) * b, b)
                    slot += row_bytes
            sent += n
        record = _elements_at(_I64, table[home, RETURNED, half] + me * R_WORDS * 8, R_WORDS)
        record[R_DTYPE], record[R_COUNT] = code, sent
        store_release(table[home, RETURNED, half] + me * R_WORDS * 8, epoch)  # the rows above are visible
        if home != me:
            woken += wake_if_asleep(asleep, home, wake)
        if masked_by(members, live, me, generation) >= 0:
            return MASKED
    status[5] = woken
    return DONE


@_jit
def _return_slots(topk, rank_of_expert, local_of_expert, R, L, per_writer):
    """int64 [N, K]: the back slot of each valid y(t, k) (-1 elsewhere). Expert rank r writes the
    rows it returns to this rank in its own run of slots (r * per_writer onwards), ordered by
    (local expert, token): the order its dispatch received them in."""
    N, K = topk.shape
    count = np.zeros(R * L, dtype=np.int64)
    for t in range(N):
        for k in range(K):
            e = topk[t, k]
            if e >= 0:
                count[rank_of_expert[e] * L + local_of_expert[e]] += 1
    at = np.empty_like(count)
    for r in range(R):
        run = r * per_writer
        for j in range(L):
            at[r * L + j] = run
            run += count[r * L + j]
    slot = np.full((N, K), -1, dtype=np.int64)
    for t in range(N):
        for k in range(K):
            e = topk[t, k]
            if e >= 0:
                i = rank_of_expert[e] * L + local_of_expert[e]
                slot[t, k] = at[i]
                at[i] += 1
    return slot


@_jit
def ll_combine_recv(
    table, asleep, me, epoch, half, live, topk, rank_of_expert, local_of_expert, code, dtype_lo,
    dtype_hi, count_hi, per_writer, row_bytes, weights, out, state, wake, members, generation,
    pending, spins, yields, status,
):  # fmt: skip
    """Once every expert rank this rank expects rows from has stamped, check them, then
    out[t] = sum over k ascending of weights[t, k] * y(t, k) where topk[t, k] >= 0 (float32, rounded
    once).

    topk int64 [N, K]: this rank's routing, masked ranks' experts dropped (the send half checked it
    is the dispatch's; its ids are checked again here, before they index anything); y(t, k) lands
    in the back slot `_return_slots` gives. out [N, H] float32, or bf16 as uint16 bits; live: the
    live ranks; state int64 [1]: the next rank to wait for. Returns DONE, WAITING, MASKED (the
    peers masked this rank: the rows may not be whole; out is written, the half not released) or
    an error code.
    """
    R = table.shape[0]
    E = rank_of_expert.size
    L = E // R
    N, H = out.shape
    K = weights.shape[1]
    lo, hi = _id_range(topk)
    if N * K and (lo < -1 or hi >= E):  # changed since the send half checked it
        return _fail(status, E_EXPERT, me, lo if lo < -1 else hi, E, 0)
    expected_R = np.zeros(R, dtype=np.int64)
    for t in range(N):
        for k in range(K):
            if topk[t, k] >= 0:
                expected_R[rank_of_expert[topk[t, k]]] += 1
    while state[0] < R:
        r = state[0]
        if expected_R[r] > 0:
            code_now = _landed(
                table, asleep, me, 1, half, epoch, RETURNED, R_WORDS, r, pending, spins, yields, status
            )
            if code_now != DONE:
                return code_now
        state[0] += 1
    for r in range(R):
        if expected_R[r] == 0:
            continue
        record = words_once(table[me, RETURNED, half] + r * R_WORDS * 8, R_WORDS)  # checked: this copy
        if not dtype_lo <= record[R_DTYPE] <= dtype_hi:
            return _fail(status, E_FIELD, r, record[R_DTYPE], 0, 0)
        if not 0 <= record[R_COUNT] <= count_hi:
            return _fail(status, E_FIELD, r, record[R_COUNT], 1, 0)
        if record[R_COUNT] != expected_R[r] or record[R_DTYPE] != code:
            return _fail(status, E_RETURNED, r, record[R_COUNT], record[R_DTYPE], expected_R[r])
    acc = np.empty(CHUNK, dtype=np.float32)
    slots = table[me, BACK_SLOTS, half]
    slot = _return_slots(topk, rank_of_expert, local_of_expert, R, L, per_writer)
    for t in range(N):
        for c in range(0, H, CHUNK):  # a chunk of the row at a time (see `ubep_halves.CHUNK`)
            width = min(CHUNK, H - c)
            acc[:width] = np.float32(0.0)
            for k in range(K):
                if slot[t, k] >= 0:
                    w = np.float32(weights[t, k])
                    row = _elements_at(out[0, :0], slots + slot[t, k] * row_bytes + c * out.itemsize, width)
                    for j in range(width):
                        acc[j] += widen(row[j]) * w
            out_row = out[t, c : c + width]
            for j in range(width):
                store(out_row, j, acc[j])
    if masked_by(members, live, me, generation) >= 0:  # the rows were whole: this rank was live
        return MASKED
    status[5] = _consumed(table, asleep, me, live, 1, half, epoch, wake)  # peers to ring
    return DONE

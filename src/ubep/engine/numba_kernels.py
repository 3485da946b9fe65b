"""The numba engine's compiled kernels, in place on numpy views of the tensors' memory.

Kernels take matrices as they come (2-D numpy views, rows possibly strided
inside a larger buffer such as a shared segment). Copies move each row with
one memmove; reductions turn each matrix into a flat 1-D view plus a row
stride (`flat_rows`), so every inner loop runs over unit-stride memory that
LLVM vectorizes. A layout they do not take (a row that
is not unit-stride, written rows that overlap) makes them return UNSUPPORTED
before touching anything; indices are checked before anything is written too.
A kernel returns OK, UNSUPPORTED, or the position (>= 0) of the first bad index.
Kernels are single-threaded and release the GIL (`nogil`), so a protocol's
worker threads run them side by side.

numba has no 16-bit float type, so 16-bit rows arrive as their bits: bf16 as
uint16, fp16 as int16; `widen` turns one stored element into its exact float32
value by element type (float32 rows pass through).

Compiled code is cached on disk (numba's `cache=True`: next to this file, or in
the user's cache directory when that is read-only), and compiled once per host
(`ubep.engine.compile_once`); where no directory is writable the kernels still
compile, once per process.
"""

from __future__ import annotations

import numba
import numpy as np
from numba.core import cgutils, types
from numba.core.imputils import impl_ret_borrowed
from numba.extending import intrinsic, overload
from numba.np.arrayobj import make_array, populate_array

CHUNK = 256  # elements of a row summed at a time (measured: 3.5x the whole-row loop at hidden 7168)
OK = -1  # every index was in range and the work is done
UNSUPPORTED = -2  # a layout the kernel does not take: nothing was touched


def _jit(fn):
    """njit, GIL released, cached on disk where a cache directory is writable."""
    try:
        return numba.njit(nogil=True, cache=True)(fn)
    except RuntimeError:  # numba found no writable cache directory: compile per process
        return numba.njit(nogil=True)(fn)


def cache_dir(kernel) -> str | None:
    """Where numba keeps a kernel's compiled code on disk, or None when it compiles per process."""
    return getattr(kernel._cache, "cache_path", None)


@intrinsic
def _bits_as_f32(typingctx, bits):
    """The float32 whose IEEE bits are the low 32 bits of integer `bits`, a register bitcast."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        low = context.cast(builder, args[0], signature.args[0], types.uint32)
        return builder.bitcast(low, context.get_value_type(types.float32))

    return types.float32(bits), codegen


U32 = np.uint32


def widen(v):
    """float32 value of one stored element (compiled only; see the overload below)."""
    raise NotImplementedError("widen runs inside numba kernels only")


@overload(widen)
def _widen(v):
    if v == types.float32:
        return lambda v: v
    if v == types.uint16:  # bf16: the top half of a float32
        return lambda v: _bits_as_f32(U32(v) << U32(16))
    if v == types.int16:  # fp16: rebias the exponent, shift the mantissa
        return _fp16_to_f32
    return None


def _fp16_to_f32(v):
    """Exact float32 of fp16 bits (compiled through `widen`). Example: 0x3C00 -> 1.0, 0x0001 -> 2**-24."""
    h = U32(v) & U32(0xFFFF)
    sign = (h & U32(0x8000)) << U32(16)
    rest = h & U32(0x7FFF)
    if rest >= U32(0x7C00):  # inf or NaN: all-ones exponent, payload kept
        return _bits_as_f32(sign | U32(0x7F800000) | ((rest & U32(0x3FF)) << U32(13)))
    if rest >= U32(0x0400):  # normal: exponent bias 15 -> 127
        return _bits_as_f32(sign | ((rest << U32(13)) + U32(112 << 23)))
    tiny = np.float32(rest) * np.float32(2.0**-24)  # subnormal or zero, exact
    return -tiny if sign else tiny


@intrinsic
def _span(typingctx, arr, length):
    """`length` elements of memory from arr's first element, as a 1-D contiguous view (no copy)."""
    if not isinstance(arr, types.Array) or not isinstance(length, types.Integer):
        return None
    flat = types.Array(arr.dtype, 1, "C")

    def codegen(context, builder, signature, args):
        src = make_array(signature.args[0])(context, builder, args[0])
        out = make_array(flat)(context, builder)
        n = context.cast(builder, args[1], signature.args[1], types.intp)
        populate_array(
            out, data=src.data, shape=[n], strides=[src.itemsize], itemsize=src.itemsize,
            meminfo=src.meminfo, parent=src.parent,
        )  # fmt: skip
        return impl_ret_borrowed(context, builder, flat, out._getvalue())

    return flat(arr, length), codegen


@intrinsic
def _elements_at(typingctx, like, address, length):
    """`length` elements of like's dtype at a raw address, as a 1-D view (memory owned elsewhere)."""
    if not isinstance(like, types.Array) or not all(isinstance(a, types.Integer) for a in (address, length)):
        return None
    flat = types.Array(like.dtype, 1, "C")

    def codegen(context, builder, signature, args):
        out = make_array(flat)(context, builder)
        itemsize = context.get_constant(types.intp, context.get_abi_sizeof(context.get_data_type(like.dtype)))
        data = builder.inttoptr(
            context.cast(builder, args[1], signature.args[1], types.intp),
            context.get_value_type(like.dtype).as_pointer(),
        )
        n = context.cast(builder, args[2], signature.args[2], types.intp)
        populate_array(out, data=data, shape=[n], strides=[itemsize], itemsize=itemsize, meminfo=None)
        return impl_ret_borrowed(context, builder, flat, out._getvalue())

    return flat(like, address, length), codegen


@_jit
def words_once(address, n):
    """n int64 words at a raw address (a peer's header or record), copied once into a new array: a half
    checks the copy and uses only the copy, which the peer cannot rewrite between the check and the use."""
    out = np.empty(n, dtype=np.int64)
    if n:
        _move(out.ctypes.data, address, n * 8)
    return out


@_jit
def unit_rows(a, written):
    """Rows (the last axis) are unit-stride, and, for a written matrix, no two rows share memory."""
    if a.size == 0:  # numpy gives empty arrays zero strides; there is nothing to touch
        return True
    if a.shape[-1] > 1 and a.strides[-1] != a.itemsize:
        return False
    return not written or a.shape[0] <= 1 or a.strides[0] >= a.shape[1] * a.itemsize


@_jit
def flat_rows(a):
    """(flat, row_stride) of a 2-D array with unit-stride rows: a[i, j] is flat[i * row_stride + j]."""
    rows, width = a.shape
    stride = a.strides[0] // a.itemsize
    return _span(a, 0 if rows == 0 or width == 0 else (rows - 1) * stride + width), stride


@_jit
def _first_bad(index, limit):
    """Position of the first index outside [0, limit), or OK."""
    for i in range(index.size):
        if index[i] < 0 or index[i] >= limit:
            return i
    return OK


@intrinsic
def _move(typingctx, dst_address, src_address, nbytes):
    """memmove(dst, src, nbytes) on raw addresses: one row at the C library's copy speed."""
    if not all(isinstance(a, types.Integer) for a in (dst_address, src_address, nbytes)):
        return None

    def codegen(context, builder, signature, args):
        dst, src, n = (
            context.cast(builder, a, t, types.intp) for a, t in zip(args, signature.args, strict=True)
        )
        cgutils.raw_memmove(
            builder, builder.inttoptr(dst, cgutils.voidptr_t), builder.inttoptr(src, cgutils.voidptr_t), n, 1
        )
        return context.get_dummy_value()

    return types.none(dst_address, src_address, nbytes), codegen


@_jit
def copy_rows(src, src_index, dst, dst_index, n):
    """dst[dst_index[i]] = src[src_index[i]] for i < n, rows of bytes (uint8 [X, B] and [Y, B]).

    An index array of size 0 stands for "rows in order" (i itself). Returns OK,
    UNSUPPORTED, or the position of the first bad index: i for src_index[i], n + i for dst_index[i].
    Example: src rows [a, b, c], src_index [2, 0], dst_index [] -> dst rows [c, a].
    """
    by_src, by_dst = src_index.size > 0, dst_index.size > 0
    src_ok = src_index.size == n if by_src else src.shape[0] == n
    dst_ok = dst_index.size == n if by_dst else dst.shape[0] >= n
    shapes_ok = src_ok and dst_ok and src.shape[1] == dst.shape[1]
    if not (shapes_ok and unit_rows(src, False) and unit_rows(dst, True)):
        return UNSUPPORTED
    bad = _first_bad(src_index, src.shape[0])
    if bad != OK:
        return bad
    bad = _first_bad(dst_index, dst.shape[0])
    if bad != OK:
        return n + bad
    src_at, dst_at = src.ctypes.data, dst.ctypes.data
    for i in range(n):
        s = src_index[i] if by_src else i
        d = dst_index[i] if by_dst else i
        _move(dst_at + d * dst.strides[0], src_at + s * src.strides[0], src.shape[1])
    return OK


@_jit
def localize_rows(topk, rows, local_of_expert, out_idx, weights, out_weights):
    """out_idx[i, k] = local_of_expert[topk[rows[i], k]] (-1 for a negative slot); weights kept where local.

    Empty `out_weights` means "no weights".
    Returns OK, or the position of the first row index out of range; an expert
    id >= E is reported as n + i (its row's position).
    Example (local_of_expert [-1, -1, 0, 1]): topk row [3, 0, -1] -> [1, -1, -1].
    """
    n, K = out_idx.shape
    num_experts = local_of_expert.size
    bad = _first_bad(rows, topk.shape[0])
    if bad != OK:
        return bad
    for i in range(n):
        for k in range(K):
            if topk[rows[i], k] >= num_experts:
                return n + i
    for i in range(n):
        for k in range(K):
            e = topk[rows[i], k]
            local = local_of_expert[e] if e >= 0 else -1
            out_idx[i, k] = local
            if out_weights.size:
                out_weights[i, k] = weights[rows[i], k] if local >= 0 else np.float32(0.0)
    return OK


@_jit
def accumulate_rows(acc, rows, token, weight):
    """acc[token[i]] += rows[i] (times weight[i] unless `weight` is empty), float32, i ascending.

    The weighted product is rounded to float32 before the add, as torch's
    `rows * weight` then `index_add_` does. Returns OK, UNSUPPORTED or the first bad token position.
    Example: acc zeros, rows [a, b, c], token [1, 0, 1] -> acc rows [b, a + c].
    """
    if not (unit_rows(acc, True) and unit_rows(rows, False)):
        return UNSUPPORTED
    bad = _first_bad(token, acc.shape[0])
    if bad != OK:
        return bad
    (acc_flat, acc_stride), (rows_flat, rows_stride) = flat_rows(acc), flat_rows(rows)
    width = acc.shape[1]
    for i in range(token.size):
        a, r = token[i] * acc_stride, i * rows_stride
        acc_row, row = acc_flat[a : a + width], rows_flat[r : r + width]
        if weight.size:
            w = np.float32(weight[i])
            for j in range(width):
                acc_row[j] += widen(row[j]) * w
        else:
            for j in range(width):
                acc_row[j] += widen(row[j])
    return OK


def store(out_row, j, v):
    """out_row[j] = float32 v in out_row's element type (compiled only; see the overload below)."""
    raise NotImplementedError("store runs inside numba kernels only")


@overload(store)
def _store(out_row, j, v):
    if out_row.dtype == types.float32:

        def exact(out_row, j, v):
            out_row[j] = v

        return exact
    if out_row.dtype == types.uint16:  # bf16 bits, rounded to nearest even as torch rounds (NaN: 0x7FC0)

        def to_bf16(out_row, j, v):
            if v != v:
                out_row[j] = np.uint16(0x7FC0)
            else:
                bits = _f32_bits(v)
                out_row[j] = np.uint16((bits + U32(0x7FFF) + ((bits >> U32(16)) & U32(1))) >> U32(16))

        return to_bf16
    return None


@intrinsic
def _f32_bits(typingctx, v):
    """The IEEE bits of a float32 as uint32, a register bitcast."""
    if v != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.uint32))

    return types.uint32(v), codegen


@_jit
def gather_blocks(address_S, stride_S, rows_S, index_M, prefix_S1, start_S, out):
    """out[start[s] + i] = row index[prefix[s] + i] of block s, for every s (rows of bytes).

    Block s holds rows_S[s] rows at address_S[s], stride_S[s] bytes apart; out is
    uint8 [M, B] with unit-stride rows, B bytes moved per row. Returns OK or the
    position in index_M of the first row out of its block's range, or of a
    destination row outside out.
    Example: blocks [[a, b], [c, d]], index [1 | 0, 1], start [0, 1] -> out [b, c, d].
    """
    S, width = address_S.size, out.shape[1]
    for s in range(S):
        first, last = prefix_S1[s], prefix_S1[s + 1]
        if start_S[s] < 0 or start_S[s] + last - first > out.shape[0]:
            return first
        for i in range(first, last):
            if index_M[i] < 0 or index_M[i] >= rows_S[s]:
                return i
    out_at = out.ctypes.data
    for s in range(S):
        first = prefix_S1[s]
        for i in range(first, prefix_S1[s + 1]):
            dst = out_at + (start_S[s] + i - first) * out.strides[0]
            _move(dst, address_S[s] + index_M[i] * stride_S[s], width)
    return OK


@_jit
def localize_blocks(
    topk_like,
    address_S,
    weights_S,
    stride_S,
    rows_S,
    index_M,
    prefix_S1,
    local_of_expert,
    out_idx,
    out_weights,
):
    """`localize_rows` over several blocks: block s's top-k rows at address_S[s] (weights at
    weights_S[s]), both stride_S[s] elements apart, rows_S[s] of them; rows index[prefix[s]:prefix[s+1]]
    fill out_idx / out_weights in order. Returns OK, the position of the first bad row
    index, or M + i for an expert id >= E in output row i.
    """
    M, K = out_idx.shape
    num_experts = local_of_expert.size
    w_like = out_weights[0, :0]
    for s in range(address_S.size):
        for i in range(prefix_S1[s], prefix_S1[s + 1]):
            row = index_M[i]
            if row < 0 or row >= rows_S[s]:
                return i
            topk = _elements_at(topk_like, address_S[s] + row * stride_S[s] * 8, K)
            w = _elements_at(w_like, weights_S[s] + row * stride_S[s] * 4, K)
            for k in range(K):
                e = topk[k]
                if e >= num_experts:
                    return M + i
                local = local_of_expert[e] if e >= 0 else -1
                out_idx[i, k] = local
                out_weights[i, k] = w[k] if local >= 0 else np.float32(0.0)
    return OK


@_jit
def reduce_blocks(like, address_S, stride_S, token_M, prefix_S1, out):
    """out[t] = float32 sum over s ascending of block s's row for token t, rounded once into out.

    Block s has rows token_M[prefix[s] : prefix[s + 1]] (ascending), its row i at
    address_S[s] + i * stride_S[s] bytes, elements of like's dtype. out is [N, H]
    float32, or bf16 as uint16 bits. Returns OK or the position of the first
    token outside [0, N) or out of ascending order.
    Example: blocks [[a, b], [c]], tokens [0, 2 | 0] -> out [a + c, 0, b].
    """
    N, H = out.shape
    S = address_S.size
    for s in range(S):
        for i in range(prefix_S1[s], prefix_S1[s + 1]):
            if token_M[i] < 0 or token_M[i] >= N or (i > prefix_S1[s] and token_M[i] <= token_M[i - 1]):
                return i
    at_S = prefix_S1[:S].copy()  # each block's next unread row
    acc = np.empty(H, dtype=np.float32)
    for t in range(N):
        acc[:] = np.float32(0.0)
        for s in range(S):
            i = at_S[s]
            if i < prefix_S1[s + 1] and token_M[i] == t:
                row = _elements_at(like, address_S[s] + (i - prefix_S1[s]) * stride_S[s], H)
                for j in range(H):
                    acc[j] += widen(row[j])
                at_S[s] = i + 1
        out_row = out[t]
        for j in range(H):
            store(out_row, j, acc[j])
    return OK


@_jit
def weighted_sum(y, w, valid, out):
    """out[n] = sum over k ascending of w[n, k] * y[n, k] where valid[n, k]; out [N, H] float32 C-contiguous.

    Starts from +0 and adds each rounded product, as `ubep.reference.weighted_sum`;
    skipping an invalid slot equals its adding +0 there (the sum never holds -0).
    Returns OK or UNSUPPORTED. Example: w [[0.5, 2]], valid [[True, False]], y [[a, NaN]] -> out [0.5 * a].
    """
    if not unit_rows(y, False):
        return UNSUPPORTED
    N, K, H = y.shape
    stride_n, stride_k = y.strides[0] // y.itemsize, y.strides[1] // y.itemsize
    y_flat = _span(y, 0 if y.size == 0 else (N - 1) * stride_n + (K - 1) * stride_k + H)
    for n in range(N):
        acc = out[n]
        acc[:] = np.float32(0.0)
        for k in range(K):
            if not valid[n, k]:
                continue
            wk = np.float32(w[n, k])
            base = n * stride_n + k * stride_k
            row = y_flat[base : base + H]
            for j in range(H):
                acc[j] += widen(row[j]) * wk
    return OK


BAD_EXPERT, REPEATED = -3, -4  # route_tokens' verdicts on a routing
BAD_SOURCE = -5  # ll_returns: a received row whose source is not a rank


@_jit
def _id_range(topk):
    """(smallest, largest) id of topk int64 [N, K], counting from (0, -1): an id outside [-1, E)
    shows as lo < -1 or hi >= E."""
    lo, hi = np.int64(0), np.int64(-1)
    for t in range(topk.shape[0]):
        for k in range(topk.shape[1]):
            lo, hi = min(lo, topk[t, k]), max(hi, topk[t, k])
    return lo, hi


@_jit
def _routing_verdict(topk, num_experts, found):
    """OK if topk int64 [N, K] holds ids in [-1, E) and no expert twice in a row; else BAD_EXPERT
    (found[0]: the smallest id if one is below -1, else the largest) or REPEATED (found[0]: the
    first such row)."""
    N, K = topk.shape
    lo, hi = _id_range(topk)
    if N * K and (lo < -1 or hi >= num_experts):
        found[0] = lo if lo < -1 else hi
        return BAD_EXPERT
    for t in range(N):
        for k in range(K):
            if topk[t, k] >= 0:
                for j in range(k):
                    if topk[t, j] == topk[t, k]:
                        found[0] = t
                        return REPEATED
    return OK


@_jit
def route_tokens(topk, rank_of_expert, num_experts, in_rank, counts, found):
    """Check a routing and lay it out in one pass: topk int64 [N, K] must hold ids in [-1, E) and no
    expert twice in a row; in_rank uint8 [N, R] gets 1 where token n selects an expert on rank r,
    counts int64 [R] the tokens per rank. Returns OK, BAD_EXPERT (found[0]: the smallest id if one
    is below -1, else the largest) or REPEATED (found[0]: the first such row), writing nothing then.
    Example (R = 2, experts 0-1 on rank 0, 2-3 on rank 1): row [3, 0] -> in_rank row [1, 1].
    """
    N, K = topk.shape
    verdict = _routing_verdict(topk, num_experts, found)
    if verdict != OK:
        return verdict
    counts[:] = 0
    for t in range(N):
        in_rank[t, :] = 0
        for k in range(K):
            if topk[t, k] >= 0:
                in_rank[t, rank_of_expert[topk[t, k]]] = 1
        for r in range(counts.size):
            counts[r] += in_rank[t, r]
    return OK


@_jit
def ll_pairs(topk, rank_of_expert, local_of_expert, found, token_P, k_P, local_P, counts_RL):
    """Check a routing as `route_tokens` does, then order its (token, expert) pairs for low-latency
    dispatch by (owner rank, local expert, token): token_P, k_P (its top-k slot) and local_P (the
    local expert id there) get the P pairs, counts_RL int64 [R, L] the pairs per (rank, local
    expert). Returns P, or BAD_EXPERT / REPEATED as `route_tokens` (writing nothing then).
    Example (R = 2, L = 2, experts 0-1 on rank 0, 2-3 on rank 1): rows [[3, 0], [1, -1]] ->
    (token, k, local) (0, 1, 0), (1, 0, 1), (0, 0, 1); counts [[1, 1], [0, 1]].
    """
    N, K = topk.shape
    R, L = counts_RL.shape
    verdict = _routing_verdict(topk, rank_of_expert.size, found)
    if verdict != OK:
        return verdict
    counts_RL[:] = 0
    for t in range(N):
        for k in range(K):
            e = topk[t, k]
            if e >= 0:
                counts_RL[rank_of_expert[e], local_of_expert[e]] += 1
    at = np.empty(R * L, dtype=np.int64)  # the next place of each (rank, local expert) bucket
    P = 0
    for r in range(R):
        for j in range(L):
            at[r * L + j] = P
            P += counts_RL[r, j]
    for t in range(N):  # tokens ascending: each bucket gets its pairs in token order
        for k in range(K):
            e = topk[t, k]
            if e >= 0:
                bucket = rank_of_expert[e] * L + local_of_expert[e]
                p = at[bucket]
                token_P[p], k_P[p], local_P[p] = t, k, local_of_expert[e]
                at[bucket] = p + 1
    return P


@_jit
def ll_owners(topk, rank_of_expert, local_of_expert, found, owner, local, expected):
    """The home side of a low-latency combine: check a routing as `route_tokens` does, then owner and
    local int64 [N, K] get the rank and local id of each selected expert (-1 where none) and
    expected int64 [R] the rows each rank returns. Returns OK, or BAD_EXPERT / REPEATED.
    Example (experts 0-1 on rank 0, 2-3 on rank 1): row [3, -1] -> owner [1, -1], local [1, -1],
    expected [0, 1].
    """
    N, K = topk.shape
    verdict = _routing_verdict(topk, rank_of_expert.size, found)
    if verdict != OK:
        return verdict
    expected[:] = 0
    for t in range(N):
        for k in range(K):
            e = topk[t, k]
            if e >= 0:
                owner[t, k], local[t, k] = rank_of_expert[e], local_of_expert[e]
                expected[owner[t, k]] += 1
            else:
                owner[t, k], local[t, k] = -1, -1
    return OK


@_jit
def ll_returns(recv_count, src_rank, found, local_Q, row_Q, counts_R):
    """The expert side of a low-latency combine: the rows a dispatch received (rows [0, recv_count[j])
    of local expert j, row i from source src_rank[j, i]) ordered by (home rank, local expert, row)
    into local_Q and row_Q, counts_R int64 [R] the rows per home. Returns Q, or BAD_SOURCE where a
    row's source is not a rank (found: its j and i).
    Example (R = 2, counts [2, 1], sources [[1, 0], [0, _]]): (local, row) (0, 1), (1, 0), (0, 0);
    counts [2, 1].
    """
    L, M = src_rank.shape
    R = counts_R.size
    counts_R[:] = 0
    for j in range(L):
        for i in range(min(recv_count[j], M)):
            home = src_rank[j, i]
            if not 0 <= home < R:
                found[0], found[1] = j, i
                return BAD_SOURCE
            counts_R[home] += 1
    at = np.empty(R, dtype=np.int64)  # the next place of each home's rows
    Q = 0
    for r in range(R):
        at[r] = Q
        Q += counts_R[r]
    for j in range(L):
        for i in range(min(recv_count[j], M)):
            q = at[src_rank[j, i]]
            local_Q[q], row_Q[q] = j, i
            at[src_rank[j, i]] = q + 1
    return Q


@_jit
def to_physical(topk, near, count, start, seen, out):
    """Logical top-k -> physical top-k through one source rank's copy table (`ubep.placement.CopyMap`).

    topk int64 [N, K] holds logical ids in [-1, E); near int64 [E, J] lists each expert's
    nearest copies, count int64 [E] how many. Pairs are taken token by token, k ascending; the
    i-th pair of expert e goes to near[e, (start + i) % count[e]], so equally near copies
    share the pairs to within one. seen int64 [E] is scratch; -1 stays -1. Returns OK, or
    BAD_EXPERT with found in seen[0] (the smallest id if one is below -1, else the largest),
    writing nothing then.
    Example (near [[4, 9]], count [2], start 1): rows [[0], [0], [0]] -> [[9], [4], [9]].
    """
    N, K = topk.shape
    E = count.size
    lo, hi = _id_range(topk)
    if N * K and (lo < -1 or hi >= E):
        seen[0] = lo if lo < -1 else hi
        return BAD_EXPERT
    seen[:] = 0
    for t in range(N):
        for k in range(K):
            e = topk[t, k]
            if e < 0:
                out[t, k] = -1
            else:
                out[t, k] = near[e, (start + seen[e]) % count[e]]
                seen[e] += 1
    return OK

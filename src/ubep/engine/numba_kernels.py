"""The numba engine's compiled kernels, on flat numpy views of row-major memory.

Each kernel sees a matrix as a flat 1-D array plus a row stride (in elements),
so rows of a larger buffer (a region inside a shared segment) need no copy and
every inner loop runs over unit-stride memory that LLVM vectorizes. Kernels are
single-threaded and release the GIL (`nogil`), so a protocol's worker threads
run them side by side. Indices are checked before anything is written: a kernel
returns -1 when all is well, else the position of the first bad index.

numba has no 16-bit float type, so 16-bit rows arrive as their bits: bf16 as
uint16, fp16 as int16; `widen` turns one stored element into its exact float32
value by element type (float32 rows pass through).

Compiled code is cached on disk (numba's `cache=True`: next to this file, or in
the user's cache directory when that is read-only); where no directory is
writable the kernels still compile, once per process.
"""

from __future__ import annotations

import numba
import numpy as np
from numba.core import types
from numba.extending import intrinsic, overload

OK = -1  # what a kernel returns when every index was in range


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
    """Exact float32 of fp16 bits. Example: 0x3C00 -> 1.0, 0x0001 -> 2**-24, 0xFC00 -> -inf."""
    h = U32(v) & U32(0xFFFF)
    sign = (h & U32(0x8000)) << U32(16)
    rest = h & U32(0x7FFF)
    if rest >= U32(0x7C00):  # inf or NaN: all-ones exponent, payload kept
        return _bits_as_f32(sign | U32(0x7F800000) | ((rest & U32(0x3FF)) << U32(13)))
    if rest >= U32(0x0400):  # normal: exponent bias 15 -> 127
        return _bits_as_f32(sign | ((rest << U32(13)) + U32(112 << 23)))
    tiny = np.float32(rest) * np.float32(2.0**-24)  # subnormal or zero, exact
    return -tiny if sign else tiny


@_jit
def _first_bad(index, limit):
    """Position of the first index outside [0, limit), or OK."""
    for i in range(index.size):
        if index[i] < 0 or index[i] >= limit:
            return i
    return OK


@_jit
def copy_rows(src, src_stride, src_rows, src_index, dst, dst_stride, dst_rows, dst_index, n, width):
    """dst row dst_index[i] = src row src_index[i] for i < n, `width` words each.

    An index array of size 0 stands for "rows in order" (i itself). Returns OK,
    or the position of the first bad index (source indices first).
    Example: src rows [a, b, c], src_index [2, 0], dst_index [] -> dst rows [c, a].
    """
    by_src = src_index.size > 0
    by_dst = dst_index.size > 0
    bad = _first_bad(src_index, src_rows)
    if bad != OK:
        return bad
    bad = _first_bad(dst_index, dst_rows)
    if bad != OK:
        return n + bad
    for i in range(n):
        s = (src_index[i] if by_src else i) * src_stride
        d = (dst_index[i] if by_dst else i) * dst_stride
        src_row, dst_row = src[s : s + width], dst[d : d + width]
        for j in range(width):  # row views and a range index: no wraparound checks, so LLVM vectorizes
            dst_row[j] = src_row[j]
    return OK


@_jit
def localize_rows(topk, rows, local_of_expert, out_idx, weights, out_weights, with_weights):
    """out_idx[i, k] = local_of_expert[topk[rows[i], k]], -1 for slot -1; weights kept where local.

    Returns OK, or the position of the first row index out of range; an expert
    id outside [-1, E) is reported as n + i (its row's position).
    Example (local_of_expert [-1, -1, 0, 1]): topk row [3, 0, -1] -> [1, -1, -1].
    """
    n, K = out_idx.shape
    num_experts = local_of_expert.size
    bad = _first_bad(rows, topk.shape[0])
    if bad != OK:
        return bad
    for i in range(n):
        for k in range(K):
            e = topk[rows[i], k]
            if e < -1 or e >= num_experts:
                return n + i
            local = local_of_expert[e] if e >= 0 else -1
            out_idx[i, k] = local
            if with_weights:
                out_weights[i, k] = weights[rows[i], k] if local >= 0 else np.float32(0.0)
    return OK


@_jit
def accumulate_rows(acc, acc_stride, acc_rows, rows, rows_stride, token, weight, with_weight, width):
    """acc row token[i] += row i (times weight[i]), float32, i ascending.

    The weighted product is rounded to float32 before the add, as torch's
    `rows * weight` then `index_add_` does. Returns OK or the first bad token position.
    Example: acc zeros, rows [a, b, c], token [1, 0, 1] -> acc rows [b, a + c].
    """
    bad = _first_bad(token, acc_rows)
    if bad != OK:
        return bad
    for i in range(token.size):
        a = token[i] * acc_stride
        acc_row, row = acc[a : a + width], rows[i * rows_stride : i * rows_stride + width]
        if with_weight:
            w = np.float32(weight[i])
            for j in range(width):
                acc_row[j] += widen(row[j]) * w
        else:
            for j in range(width):
                acc_row[j] += widen(row[j])
    return OK


@_jit
def weighted_sum(y, y_stride_n, y_stride_k, w, valid, out, width):
    """out[n] = sum over k ascending of w[n, k] * y[n, k] where valid[n, k]; out [N, H] C-contiguous.

    Starts from +0 and adds each rounded product, as `ubep.reference.weighted_sum`;
    skipping an invalid slot equals its adding +0 there (the sum never holds -0).
    Example: w [[0.5, 2]], valid [[True, False]], y [[a, NaN]] -> out [0.5 * a].
    """
    N, K = w.shape
    for n in range(N):
        acc = out[n]
        acc[:] = np.float32(0.0)
        for k in range(K):
            if not valid[n, k]:
                continue
            wk = np.float32(w[n, k])
            base = n * y_stride_n + k * y_stride_k
            row = y[base : base + width]
            for j in range(width):
                acc[j] += widen(row[j]) * wk
    return OK

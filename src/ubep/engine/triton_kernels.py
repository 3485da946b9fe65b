"""Triton kernels for the kernel interface: one source for CPU tests (the interpreter) and GPU runs.

    routing -> layout -> schedule -> protocol -> [engine: triton] -> transport

Every kernel reads and writes through pointers: a peer's memory is either a
tensor view the transport handed out or an entry of a pointer table (an int64
tensor of base addresses, cast in the kernel), never a host-side copy.

Exactness: arithmetic follows `ubep.engine.torch_engine` operation for
operation. Sums walk rows in the given order (no float atomics); divisions are
IEEE (`div_rn`); float -> bf16 and float -> e4m3 conversions are written with
integer bit operations that reproduce torch's rounding (round to nearest even,
torch's NaN encodings), because the interpreter's own float casts truncate and
a GPU's cast encodes NaN differently. Launches pass `enable_fp_fusion=False` so
no multiply and add are fused into an FMA.

Memory ordering (docs/device.md has the argument):
- flag after data: the writer's programs each arrive on a counter with a
  system-scope release; the last one stamps the flag with a system-scope
  release exchange; a reader waits with a system-scope acquire, bounded by an
  iteration count, and reports a timeout instead of hanging;
- data as flag: every 8-byte word carries 4 payload bytes and the 4-byte
  epoch, written by one 8-byte relaxed system-scope atomic, so a reader that
  sees the epoch in a word has that word's payload: no flag, no fence.

Legend: see `ubep.layout`; n rows moved by one launch, W words per row, P peers
in a pointer table.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP8_BLOCK: tl.constexpr = tl.constexpr(128)  # channels per scale (ubep.fp8.BLOCK)


@triton.jit
def _row(index_n, i, INDEXED: tl.constexpr):
    """Row i itself, or index[i]; as int64 so row * stride never overflows."""
    if INDEXED:
        row = tl.load(index_n + i).to(tl.int64)
    else:
        row = i.to(tl.int64)
    return row


@triton.jit
def _base(ptr, peer_n, i, WORD: tl.constexpr, PEERS: tl.constexpr):
    """The memory a row lives in: the tensor itself, or the peer[i]-th entry of a pointer table."""
    if PEERS:
        peer = tl.load(peer_n + i)
        base = tl.load(ptr + peer).to(tl.pointer_type(WORD))
    else:
        base = ptr
    return base


@triton.jit
def _copy_row_block(
    src,
    src_peer_n,
    src_index_n,
    src_stride,
    dst,
    dst_peer_n,
    dst_index_n,
    dst_stride,
    W,
    WORD: tl.constexpr,
    SRC_PEERS: tl.constexpr,
    DST_PEERS: tl.constexpr,
    SRC_INDEXED: tl.constexpr,
    DST_INDEXED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < W
    src_base = _base(src, src_peer_n, i, WORD, SRC_PEERS)
    dst_base = _base(dst, dst_peer_n, i, WORD, DST_PEERS)
    words = tl.load(src_base + _row(src_index_n, i, SRC_INDEXED) * src_stride + cols, mask=mask)
    tl.store(dst_base + _row(dst_index_n, i, DST_INDEXED) * dst_stride + cols, words, mask=mask)


@triton.jit
def copy_rows_kernel(
    src,
    src_peer_n,
    src_index_n,
    src_stride,
    dst,
    dst_peer_n,
    dst_index_n,
    dst_stride,
    W,
    WORD: tl.constexpr,
    SRC_PEERS: tl.constexpr,
    DST_PEERS: tl.constexpr,
    SRC_INDEXED: tl.constexpr,
    DST_INDEXED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """dst[dst_index[i]] = src[src_index[i]], W words per row; program (i, column block).

    With SRC_PEERS, `src` is a pointer table and row i is read from peer
    src_peer[i]'s memory (a gather from several peers in one launch); DST_PEERS
    likewise scatters into several peers. Example: table [A, B], peer [1, 0],
    src_index [2, 0] -> dst rows [B[2], A[0]].
    """
    _copy_row_block(
        src,
        src_peer_n,
        src_index_n,
        src_stride,
        dst,
        dst_peer_n,
        dst_index_n,
        dst_stride,
        W,
        WORD,
        SRC_PEERS,
        DST_PEERS,
        SRC_INDEXED,
        DST_INDEXED,
        BLOCK,
    )


@triton.jit
def put_rows_flag_kernel(
    src,
    src_peer_n,
    src_index_n,
    src_stride,
    dst,
    dst_peer_n,
    dst_index_n,
    dst_stride,
    W,
    arrivals,
    flag,
    epoch,
    programs,
    WORD: tl.constexpr,
    SRC_PEERS: tl.constexpr,
    DST_PEERS: tl.constexpr,
    SRC_INDEXED: tl.constexpr,
    DST_INDEXED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Flag after data: copy rows as `copy_rows_kernel`, then the last program stamps `flag` = epoch.

    Each program's stores are ordered before its arrival by a block barrier
    and a system-scope release; the last of `programs` arrivals (acquire)
    resets the counter and publishes the epoch with a system-scope release, so
    a reader that acquires the epoch sees every row. One release per message.
    """
    _copy_row_block(
        src,
        src_peer_n,
        src_index_n,
        src_stride,
        dst,
        dst_peer_n,
        dst_index_n,
        dst_stride,
        W,
        WORD,
        SRC_PEERS,
        DST_PEERS,
        SRC_INDEXED,
        DST_INDEXED,
        BLOCK,
    )
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals, 1, sem="acq_rel", scope="sys")
    if arrived == programs - 1:
        tl.atomic_xchg(arrivals, 0, sem="relaxed", scope="sys")
        tl.atomic_xchg(flag, epoch, sem="release", scope="sys")


@triton.jit
def flag_write_kernel(flag_n, epoch):
    """flag[i] = epoch with system-scope release (after everything this stream wrote before)."""
    tl.atomic_xchg(flag_n + tl.program_id(0), epoch, sem="release", scope="sys")


@triton.jit
def flag_wait_kernel(flag_n, epoch, landed_n, max_spins):
    """landed[i] = 1 once flag[i] == epoch (system-scope acquire), 0 after `max_spins` reads without it.

    The spin is bounded so a silent peer makes the caller time out instead of
    hanging the device; the compare-and-swap writes back what it read, so the
    flag's value never changes.
    """
    i = tl.program_id(0)
    seen = tl.atomic_cas(flag_n + i, epoch, epoch, sem="acquire", scope="sys")
    spins = 0
    while (seen != epoch) & (spins < max_spins):
        seen = tl.atomic_cas(flag_n + i, epoch, epoch, sem="acquire", scope="sys")
        spins += 1
    tl.debug_barrier()
    tl.store(landed_n + i, (seen == epoch).to(tl.int32))


@triton.jit
def pack_put_kernel(
    src,
    src_index_n,
    src_stride,
    dst,
    dst_index_n,
    dst_stride,
    epoch,
    W,
    SRC_INDEXED: tl.constexpr,
    DST_INDEXED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Data as flag, sender: int32 payload word j of a row -> int64 word (epoch << 32) | payload.

    Each word is written by one 8-byte relaxed system-scope atomic exchange, so
    a reader sees either the old word or the whole new one. Example: epoch 5,
    payload 0xABCD -> word 0x00000005_0000ABCD.
    """
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < W
    payload = tl.load(src + _row(src_index_n, i, SRC_INDEXED) * src_stride + cols, mask=mask)
    word = (epoch.to(tl.int64) << 32) | payload.to(tl.uint32, bitcast=True).to(tl.int64)
    ptrs = dst + _row(dst_index_n, i, DST_INDEXED) * dst_stride + cols
    tl.atomic_xchg(ptrs, word, mask=mask, sem="relaxed", scope="sys")


@triton.jit
def unpack_wait_kernel(
    src,
    src_index_n,
    src_stride,
    dst,
    dst_index_n,
    dst_stride,
    epoch,
    W,
    max_spins,
    missing,
    SRC_INDEXED: tl.constexpr,
    DST_INDEXED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Data as flag, receiver: wait until every word of a row block carries `epoch`, then keep its payload.

    Program (i, column block) polls its words with volatile loads, at most
    `max_spins` times; words that arrived are written to dst (int32), and the
    count of words that did not is added to `missing` (0: the row is complete).
    """
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < W
    ptrs = src + _row(src_index_n, i, SRC_INDEXED) * src_stride + cols
    want = epoch.to(tl.int32)
    words = tl.load(ptrs, mask=mask, other=0, volatile=True)
    late = mask & ((words >> 32).to(tl.int32) != want)
    pending = tl.sum(late.to(tl.int32), axis=0)
    spins = 0
    while (pending > 0) & (spins < max_spins):
        words = tl.load(ptrs, mask=mask, other=0, volatile=True)
        late = mask & ((words >> 32).to(tl.int32) != want)
        pending = tl.sum(late.to(tl.int32), axis=0)
        spins += 1
    out = dst + _row(dst_index_n, i, DST_INDEXED) * dst_stride + cols
    tl.store(out, words.to(tl.int32), mask=mask & ~late)
    if pending > 0:
        tl.atomic_add(missing, pending, sem="relaxed", scope="gpu")


@triton.jit
def accumulate_rows_kernel(
    acc,
    acc_stride,
    rows,
    rows_stride,
    order_n,
    starts_N,
    weight_n,
    H,
    WEIGHTED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """acc[t] += rows[i] (* weight[i]) in float32 for the rows i of token t, i ascending.

    Program (t, column block) walks order[starts[t] : starts[t + 1]], the rows
    of token t in their given order (a CSR), so every sum is the sequential
    one, bit for bit. Example: token [1, 0, 1] -> order [1, 0, 2],
    starts [0, 1, 3]: token 0 adds row 1; token 1 adds row 0, then row 2.
    """
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    first = tl.load(starts_N + t)
    last = tl.load(starts_N + t + 1)
    if last > first:
        acc_ptrs = acc + t.to(tl.int64) * acc_stride + cols
        total = tl.load(acc_ptrs, mask=mask)
        j = first
        while j < last:  # not range(first, last): Triton 3.6's interpreter cannot index with loaded scalars
            i = tl.load(order_n + j).to(tl.int64)
            row = tl.load(rows + i * rows_stride + cols, mask=mask).to(tl.float32)
            if WEIGHTED:
                row = row * tl.load(weight_n + i)
            total = total + row
            j += 1
        tl.store(acc_ptrs, total, mask=mask)


@triton.jit
def weighted_sum_kernel(y, y_stride_n, y_stride_k, w, valid, K, out, H, BLOCK: tl.constexpr):
    """out[n] = sum over k ascending of w[n, k] * y[n, k]; invalid slots add w = y = 0 (NaN there dropped).

    The statement of `ubep.reference.weighted_sum`, one program per (token, column block).
    """
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    total = tl.zeros([BLOCK], dtype=tl.float32)
    k = 0
    while k < K:  # as in accumulate_rows_kernel: a while loop runs on Triton 3.6's interpreter too
        ok = tl.load(valid + n * K + k) != 0
        weight = tl.where(ok, tl.load(w + n * K + k), 0.0)
        row = tl.load(y + n * y_stride_n + k * y_stride_k + cols, mask=mask).to(tl.float32)
        row = tl.where(ok, row, 0.0)
        total = total + weight * row
        k += 1
    tl.store(out + n * H + cols, total, mask=mask)


@triton.jit
def localize_rows_kernel(
    topk,
    topk_stride,
    weights,
    weights_stride,
    rows_n,
    local_of_expert_E,
    out_idx,
    out_weights,
    count,
    K,
    WEIGHTED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out_idx[i, k] = local_of_expert[topk[rows[i], k]] (-1 elsewhere); weights kept there, else 0."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < count
    i = offs // K
    k = offs % K
    row = tl.load(rows_n + i, mask=mask, other=0).to(tl.int64)
    expert = tl.load(topk + row * topk_stride + k, mask=mask, other=-1)
    local = tl.load(local_of_expert_E + tl.maximum(expert, 0), mask=mask, other=-1)
    local = tl.where(expert >= 0, local, -1)
    tl.store(out_idx + offs, local, mask=mask)
    if WEIGHTED:
        weight = tl.load(weights + row * weights_stride + k, mask=mask, other=0.0)
        tl.store(out_weights + offs, tl.where(local >= 0, weight, 0.0), mask=mask)


@triton.jit
def _e4m3_bits(v):
    """float32 (NaN or |v| <= 448) -> e4m3fn bits, rounded to nearest even exactly as torch's cast.

    Subnormal results come from a float add that rounds at 2^-9 (torch's trick);
    NaN -> 0x7F with the sign. Example: 1.0 -> 0x38, -448.0 -> 0xFE, 2^-10 -> 0x00.
    """
    bits = v.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    mag = bits ^ sign
    denorm_bits = (mag.to(tl.float32, bitcast=True) + 16384.0).to(tl.uint32, bitcast=True)
    subnormal = denorm_bits - 0x46800000  # 141 << 23
    odd = (mag >> 20) & 1
    normal = (mag + 0xC407FFFF + odd) >> 20  # rebias 127 -> 7 ((-120 << 23) mod 2^32) + half-ulp - 1
    result = tl.where(mag < 0x3C800000, subnormal, normal)  # 0x3C800000 = 2^-6, e4m3's smallest normal
    result = tl.where(mag >= 0x43F00000, 0x7F, result)  # NaN (finite inputs were clamped to 448 < 480)
    return (result | (sign >> 24)).to(tl.uint8)


@triton.jit
def _e4m3_value(b):
    """e4m3fn bits (uint8) -> float32, exactly; NaN as 0x7FC00000 (NaN bits are not in the contract)."""
    bits = b.to(tl.uint32)
    sign = (bits & 0x80) << 24
    exponent = (bits >> 3) & 0xF
    mantissa = bits & 0x7
    normal = sign | ((exponent + 120) << 23) | (mantissa << 20)
    tiny = (mantissa.to(tl.float32) * 0.001953125).to(tl.uint32, bitcast=True) | sign  # m * 2^-9
    result = tl.where(exponent == 0, tiny, normal)
    result = tl.where((bits & 0x7F) == 0x7F, 0x7FC00000, result)
    return result.to(tl.float32, bitcast=True)


@triton.jit
def _bf16_bits(v):
    """float32 -> bf16 bits as int16, rounded to nearest even; NaN -> 0x7FC0 (torch's encoding)."""
    bits = v.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(v != v, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def quantize_rows_kernel(
    x,
    x_stride,
    src_index_n,
    values,
    values_stride,
    scales,
    scales_stride,
    dst_index_n,
    NB,
    SRC_INDEXED: tl.constexpr,
    DST_INDEXED: tl.constexpr,
    BB: tl.constexpr,
):
    """FP8 while moving: row src_index[i] of x -> e4m3 values and float32 scales at row dst_index[i].

    `ubep.fp8.quantize` per block of 128 channels: scale = amax|x| / 448 (NaN if
    the block holds one), values = clamp(x / scale, +-448) rounded to e4m3 (a
    zero block: scale 0, values 0). Program (i, group of BB blocks).
    """
    i = tl.program_id(0)
    blocks = tl.program_id(1) * BB + tl.arange(0, BB)
    cols = blocks[:, None] * FP8_BLOCK + tl.arange(0, FP8_BLOCK)[None, :]
    mask = (blocks < NB)[:, None]
    src = _row(src_index_n, i, SRC_INDEXED)
    block = tl.load(x + src * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    magnitude = tl.abs(block)
    has_nan = tl.max((magnitude != magnitude).to(tl.int32), axis=1) > 0
    scale = tl.math.div_rn(tl.max(magnitude, axis=1), 448.0)
    scale = tl.where(has_nan, float("nan"), scale)
    safe = tl.where(scale > 0, scale, 1.0)
    scaled = tl.math.div_rn(block, safe[:, None])
    scaled = tl.where(scaled > 448.0, 448.0, scaled)
    scaled = tl.where(scaled < -448.0, -448.0, scaled)
    dst = _row(dst_index_n, i, DST_INDEXED)
    tl.store(values + dst * values_stride + cols, _e4m3_bits(scaled), mask=mask)
    tl.store(scales + dst * scales_stride + blocks, scale, mask=blocks < NB)


@triton.jit
def dequantize_rows_kernel(
    values,
    values_stride,
    scales,
    scales_stride,
    src_index_n,
    out,
    out_stride,
    dst_index_n,
    NB,
    OUT_BF16: tl.constexpr,
    SRC_INDEXED: tl.constexpr,
    DST_INDEXED: tl.constexpr,
    BB: tl.constexpr,
):
    """FP8 while moving: e4m3 values * scale (float32) -> out row dst_index[i], fp32 or bf16 (int16 bits)."""
    i = tl.program_id(0)
    blocks = tl.program_id(1) * BB + tl.arange(0, BB)
    cols = blocks[:, None] * FP8_BLOCK + tl.arange(0, FP8_BLOCK)[None, :]
    mask = (blocks < NB)[:, None]
    src = _row(src_index_n, i, SRC_INDEXED)
    bits = tl.load(values + src * values_stride + cols, mask=mask, other=0)
    scale = tl.load(scales + src * scales_stride + blocks, mask=blocks < NB, other=0.0)
    x = _e4m3_value(bits) * scale[:, None]
    dst = _row(dst_index_n, i, DST_INDEXED)
    if OUT_BF16:
        tl.store(out + dst * out_stride + cols, _bf16_bits(x), mask=mask)
    else:
        tl.store(out + dst * out_stride + cols, x, mask=mask)

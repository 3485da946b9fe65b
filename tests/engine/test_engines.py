"""Every engine's kernels against plain row-by-row references, bit for bit.

The references here move or add one row at a time in the order the contract
states (and `ubep.reference.weighted_sum` for the low-latency sum), so they
share no code with either engine. No rank processes: kernels only.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time

import pytest
import torch

from ubep import reference
from ubep.engine import TorchEngine, choose_engine
from ubep.engine.base import BlockIndexError
from ubep.registry import ENGINES, choices

ENGINE_NAMES = ["torch", "numba"]
ROW_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# Row widths in bytes: odd sizes that force narrow words, and the bench's bf16 row of 7168.
WIDTHS_BYTES = [6, 14, 7168 * 2]
COPY_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.uint8, torch.int64]


def make_engine(name: str):
    if name == "numba":
        pytest.importorskip("numba")
        from ubep.engine.numba_engine import NumbaEngine

        return NumbaEngine()
    return TorchEngine()


@pytest.fixture(params=ENGINE_NAMES)
def engine(request):
    return make_engine(request.param)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of t (any dtype, any strides) as a flat uint8 tensor, for bitwise comparison."""
    return t.contiguous().view(torch.uint8).flatten()


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    if not torch.equal(bits(got), bits(want)):
        diff = (bits(got) != bits(want)).nonzero().flatten()
        raise AssertionError(f"{diff.numel()} bytes differ, first at byte {int(diff[0])}")


def random_rows(n: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """n rows of `width` elements of dtype, values spread over many exponents."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.int64:
        return torch.randint(-(2**62), 2**62, (n, width), generator=gen)
    if dtype == torch.uint8:  # FP8 values and scales travel as raw bytes
        return torch.randint(0, 256, (n, width), generator=gen, dtype=torch.uint8)
    values = torch.randn(n, width, generator=gen) * torch.exp2(
        torch.randint(-8, 8, (n, width), generator=gen)
    )
    return values.to(dtype)


def strided(rows_XW: torch.Tensor, pad: int) -> torch.Tensor:
    """The same rows as a view into a larger buffer: `pad` extra elements before every row."""
    X, W = rows_XW.shape
    big = torch.zeros(X, W + pad, dtype=rows_XW.dtype)
    big[:, pad:] = rows_XW
    view = big[:, pad:]
    assert view.stride(0) == W + pad and view.storage_offset() == pad
    return view


def elements(width_bytes: int, dtype: torch.dtype) -> int | None:
    size = dtype.itemsize
    return width_bytes // size if width_bytes % size == 0 else None


# -- copy_rows --------------------------------------------------------------------------------------------

COPY_CASES = [(d, w) for d in COPY_DTYPES for w in [*WIDTHS_BYTES, 16] if elements(w, d)]
ROW_CASES = [(d, w) for d in ROW_DTYPES for w in WIDTHS_BYTES if elements(w, d)]


@pytest.mark.parametrize("mode", ["gather", "scatter", "both", "in_order", "empty"])
@pytest.mark.parametrize("pad", [0, 3])
@pytest.mark.parametrize(("dtype", "width_bytes"), COPY_CASES)
def test_copy_rows_matches_row_by_row(engine, dtype, width_bytes, pad, mode):
    W = elements(width_bytes, dtype)
    X, Y, n = 9, 11, 0 if mode == "empty" else 6
    gen = torch.Generator().manual_seed(X * W + pad)
    src_XW = strided(random_rows(X, W, dtype, seed=W), pad)
    dst_YW = strided(random_rows(Y, W, dtype, seed=W + 1), pad)
    src_index = torch.randint(0, X, (n,), generator=gen)  # repeats allowed
    dst_index = torch.randperm(Y, generator=gen)[:n]  # distinct
    src_i, dst_i = {
        "gather": (src_index, None),
        "scatter": (None, dst_index),
        "both": (src_index, dst_index),
        "in_order": (None, None),
        "empty": (src_index, None),
    }[mode]
    if mode in ("scatter", "in_order"):
        src_XW = src_XW[:n]
    want = dst_YW.clone()
    for i in range(n):
        want[i if dst_i is None else int(dst_i[i])] = src_XW[i if src_i is None else int(src_i[i])]
    engine.copy_rows(src_XW, src_i, dst_YW, dst_i)
    assert_same_bits(dst_YW, want)


def test_copy_rows_empty_scatter_index_changes_nothing(engine):
    dst_YW = random_rows(4, 7, torch.bfloat16, seed=1)
    want = dst_YW.clone()
    engine.copy_rows(dst_YW[:0], None, dst_YW, torch.empty(0, dtype=torch.int64))
    assert_same_bits(dst_YW, want)


def test_copy_rows_rejects_index_sizes_that_disagree(engine):
    src_XW, dst_YW = random_rows(5, 4, torch.float32, seed=1), random_rows(5, 4, torch.float32, seed=2)
    with pytest.raises((RuntimeError, IndexError)):
        engine.copy_rows(src_XW, torch.tensor([0, 1, 2]), dst_YW, torch.tensor([4, 3]))


def test_copy_rows_bytes_between_rows_untouched(engine):
    """Only the rows' own bytes change: the padding between strided rows keeps its bits."""
    big = random_rows(8, 10, torch.bfloat16, seed=2)
    before = big.clone()
    src = random_rows(3, 7, torch.bfloat16, seed=3)
    engine.copy_rows(src, None, big[:, 2:9], torch.tensor([5, 0, 6]))
    untouched = torch.ones_like(big, dtype=torch.bool)
    untouched[[5, 0, 6], 2:9] = False
    assert_same_bits(big[untouched], before[untouched])
    assert_same_bits(big[[5, 0, 6], 2:9], src)


# -- localize_rows ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_weights", [False, True])
def test_localize_rows_matches_row_by_row(engine, with_weights):
    gen = torch.Generator().manual_seed(5)
    X, K, E = 12, 4, 16
    topk_XK = torch.randint(-1, E, (X, K), generator=gen)
    weights_XK = torch.rand(X, K, generator=gen)
    local_of_expert_E = torch.full((E,), -1)
    local_of_expert_E[[3, 8, 9, 14]] = torch.tensor([0, 1, 2, 3])
    rows_n = torch.tensor([11, 0, 5, 5, 7])
    out_idx_nK = torch.full((5, K), 99)
    out_w_nK = torch.full((5, K), 9.0) if with_weights else None
    engine.localize_rows(topk_XK, weights_XK, rows_n, local_of_expert_E, out_idx_nK, out_w_nK)
    for i, row in enumerate(rows_n.tolist()):
        for k in range(K):
            e = int(topk_XK[row, k])
            local = int(local_of_expert_E[e]) if e >= 0 else -1
            assert int(out_idx_nK[i, k]) == local
            if with_weights:
                assert float(out_w_nK[i, k]) == (float(weights_XK[row, k]) if local >= 0 else 0.0)


# -- accumulate_rows --------------------------------------------------------------------------------------


def accumulate_one_by_one(acc_NH, rows_nH, token_n, weight_n=None):
    """acc[token[i]] += rows[i] (* weight[i]) for i ascending, one float32 row at a time."""
    for i in range(token_n.numel()):
        row_H = rows_nH[i].float()
        if weight_n is not None:
            row_H = row_H * weight_n[i]
        acc_NH[int(token_n[i])] += row_H


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("pad", [0, 5])
@pytest.mark.parametrize(("dtype", "width_bytes"), ROW_CASES)
def test_accumulate_rows_matches_row_by_row(engine, dtype, width_bytes, pad, weighted):
    H = elements(width_bytes, dtype)
    N, n = 7, 20
    gen = torch.Generator().manual_seed(H + pad)
    rows_nH = strided(random_rows(n, H, dtype, seed=H), pad)
    token_n = torch.randint(0, N, (n,), generator=gen)
    weight_n = torch.rand(n, generator=gen) * 3 - 1 if weighted else None
    acc_NH = strided(torch.randn(N, H, generator=gen), pad)
    want = acc_NH.clone()
    accumulate_one_by_one(want, rows_nH, token_n, weight_n)
    engine.accumulate_rows(acc_NH, rows_nH, token_n, weight_n)
    assert_same_bits(acc_NH, want)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", ROW_DTYPES)
def test_accumulate_rows_inf_and_nan_stay_in_their_token(engine, dtype, weighted):
    """NaN, +Inf and -Inf in single rows: exactly the reference's bits, and no other token touched."""
    N, H = 6, 40
    rows_nH = random_rows(8, H, dtype, seed=9)
    rows_nH[1, 3] = float("nan")
    rows_nH[2, 4] = float("inf")
    rows_nH[5, 4] = float("-inf")  # same token as row 2: inf + -inf = NaN there
    rows_nH[6, 7] = float("inf")
    token_n = torch.tensor([0, 1, 2, 3, 0, 2, 4, 3])
    weight_n = torch.tensor([0.5, 2.0, 1.0, -1.0, 3.0, 1.0, 0.0, 1.0]) if weighted else None  # 0 * inf = NaN
    acc_NH = torch.zeros(N, H)
    want = acc_NH.clone()
    accumulate_one_by_one(want, rows_nH, token_n, weight_n)
    engine.accumulate_rows(acc_NH, rows_nH, token_n, weight_n)
    assert_same_bits(acc_NH, want)
    assert torch.isnan(acc_NH[1, 3]) and torch.isnan(acc_NH[2, 4])
    assert torch.isfinite(acc_NH[[0, 3, 5]]).all()


def test_int32_indices_work_like_int64(engine):
    src_XW, dst_YW = random_rows(6, 10, torch.bfloat16, seed=11), random_rows(4, 10, torch.bfloat16, seed=12)
    want = dst_YW.clone()
    want[3], want[0] = src_XW[5], src_XW[1]
    engine.copy_rows(
        src_XW, torch.tensor([5, 1], dtype=torch.int32), dst_YW, torch.tensor([3, 0], dtype=torch.int32)
    )
    assert_same_bits(dst_YW, want)
    acc_NH, want_NH = torch.zeros(3, 10), torch.zeros(3, 10)
    accumulate_one_by_one(want_NH, src_XW, torch.tensor([2, 0, 2, 1, 0, 2]))
    engine.accumulate_rows(acc_NH, src_XW, torch.tensor([2, 0, 2, 1, 0, 2], dtype=torch.int32))
    assert_same_bits(acc_NH, want_NH)


def test_accumulate_rows_empty_index_changes_nothing(engine):
    acc_NH = torch.randn(3, 5)
    want = acc_NH.clone()
    engine.accumulate_rows(acc_NH, torch.empty(0, 5, dtype=torch.bfloat16), torch.empty(0, dtype=torch.int64))
    assert_same_bits(acc_NH, want)


# -- weighted_sum -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["contiguous", "k_major_view"])
@pytest.mark.parametrize(("dtype", "width_bytes"), ROW_CASES)
def test_weighted_sum_matches_reference(engine, dtype, width_bytes, layout):
    H = elements(width_bytes, dtype)
    N, K = 9, 4
    gen = torch.Generator().manual_seed(H)
    y = random_rows(N * K, H, dtype, seed=H)
    y_NKH = y.view(N, K, H) if layout == "contiguous" else y.view(K, N, H).transpose(0, 1)
    w_NK = torch.rand(N, K, generator=gen) * 2 - 0.5
    valid_NK = torch.rand(N, K, generator=gen) > 0.3
    assert_same_bits(
        engine.weighted_sum(y_NKH, w_NK, valid_NK), reference.weighted_sum(y_NKH, w_NK, valid_NK)
    )


def test_weighted_sum_of_no_tokens(engine):
    got = engine.weighted_sum(
        torch.zeros(0, 4, 16, dtype=torch.bfloat16), torch.zeros(0, 4), torch.zeros(0, 4) > 0
    )
    assert got.shape == (0, 16) and got.dtype == torch.float32


def test_numba_takes_empty_tensors_itself():
    """Empty inputs stay on the compiled path (numpy gives them zero strides)."""
    from ubep.engine.numba_engine import NoFallback

    engine = make_engine("numba")
    engine.fallback = NoFallback()  # a hand-off to torch raises
    assert engine.weighted_sum(
        torch.zeros(0, 4, 16, dtype=torch.bfloat16), torch.zeros(0, 4), torch.zeros(0, 4) > 0
    ).shape == (0, 16)
    engine.accumulate_rows(torch.zeros(3, 16), torch.zeros(0, 16), torch.zeros(0, dtype=torch.int64))


@pytest.mark.parametrize("dtype", ROW_DTYPES)
def test_weighted_sum_nan_in_invalid_slot_adds_nothing(engine, dtype):
    N, K, H = 5, 3, 16
    y_NKH = random_rows(N * K, H, dtype, seed=4).view(N, K, H)
    w_NK = torch.rand(N, K) + 0.1
    valid_NK = torch.ones(N, K, dtype=torch.bool)
    valid_NK[0, 1] = valid_NK[3, 2] = False
    y_NKH[0, 1] = float("nan")  # invalid: must not reach token 0
    y_NKH[3, 2, 5] = float("inf")  # invalid
    y_NKH[1, 0, 2] = float("nan")  # valid: token 1, channel 2 only
    y_NKH[2, 1, 3] = float("inf")
    y_NKH[2, 2, 3] = float("-inf")  # valid: inf + -inf = NaN at token 2, channel 3
    got = engine.weighted_sum(y_NKH, w_NK, valid_NK)
    assert_same_bits(got, reference.weighted_sum(y_NKH, w_NK, valid_NK))
    assert torch.isfinite(got[[0, 3, 4]]).all()
    assert torch.isnan(got[1, 2]) and torch.isnan(got[2, 3])
    assert torch.isfinite(got[1, :2]).all() and torch.isfinite(got[1, 3:]).all()


# -- the numba engine's own paths -------------------------------------------------------------------------


def test_numba_rejects_out_of_range_index_before_writing():
    engine = make_engine("numba")
    dst_YW = random_rows(4, 8, torch.float32, seed=6)
    want = dst_YW.clone()
    with pytest.raises(IndexError, match="dst_index"):
        engine.copy_rows(random_rows(2, 8, torch.float32, seed=7), None, dst_YW, torch.tensor([1, 4]))
    with pytest.raises(IndexError, match="src_index"):
        engine.copy_rows(random_rows(2, 8, torch.float32, seed=7), torch.tensor([0, -1]), dst_YW, None)
    with pytest.raises(IndexError, match="token"):
        engine.accumulate_rows(dst_YW, random_rows(2, 8, torch.float32, seed=8), torch.tensor([0, 9]))
    assert_same_bits(dst_YW, want)


def test_numba_falls_back_on_layouts_it_does_not_take():
    """Rows with a non-unit stride along the row go to the torch engine, with the same result."""
    engine = make_engine("numba")
    rows_Hn = random_rows(12, 5, torch.bfloat16, seed=10)
    rows_nH = rows_Hn.t()  # [5, 12], stride along a row is 5
    token_n = torch.tensor([2, 0, 2, 1, 0])
    acc_NH = torch.zeros(3, 12)
    want = acc_NH.clone()
    accumulate_one_by_one(want, rows_nH, token_n)
    engine.accumulate_rows(acc_NH, rows_nH, token_n)
    assert_same_bits(acc_NH, want)


def test_numba_kernels_run_side_by_side_in_threads():
    """Four threads each accumulate into their own buffer at once; every result is exact."""
    engine = make_engine("numba")
    N, H, n = 16, 1024, 200
    jobs = []
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        rows_nH = random_rows(n, H, torch.bfloat16, seed=seed)
        token_n = torch.randint(0, N, (n,), generator=gen)
        want = torch.zeros(N, H)
        accumulate_one_by_one(want, rows_nH, token_n)
        jobs.append((torch.zeros(N, H), rows_nH, token_n, want))

    def work(acc_NH, rows_nH, token_n, _want):
        for _ in range(3):
            acc_NH.zero_()
            engine.accumulate_rows(acc_NH, rows_nH, token_n)

    threads = [threading.Thread(target=work, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for acc_NH, _, _, want in jobs:
        assert_same_bits(acc_NH, want)


def test_numba_kernels_release_the_gil():
    """While a thread runs a long kernel, this one keeps running Python (impossible were the GIL held)."""
    engine = make_engine("numba")
    n, H = 1_500_000, 2048  # about a second of work, so the Python around the kernel call is negligible
    acc_NH = torch.zeros(1, H)
    rows_nH = torch.ones(1, H, dtype=torch.bfloat16).expand(n, H)  # one row read n times: little memory
    token_n = torch.zeros(n, dtype=torch.int64)
    engine.accumulate_rows(acc_NH, rows_nH[:2], token_n[:2])  # compile or load first (same layout)
    acc_NH.zero_()
    span = {}

    def work():
        span["start"] = time.perf_counter()
        engine.accumulate_rows(acc_NH, rows_nH, token_n)
        span["end"] = time.perf_counter()

    worker = threading.Thread(target=work)
    ticks = []
    worker.start()
    while worker.is_alive():
        ticks.append(time.perf_counter())
    worker.join()
    times = [span["start"], *(t for t in ticks if span["start"] < t < span["end"]), span["end"]]
    longest_stall = max(b - a for a, b in itertools.pairwise(times))  # the whole kernel, were the GIL held
    assert longest_stall < 0.5 * (span["end"] - span["start"])
    assert torch.equal(acc_NH, torch.full((1, H), float(n)))


# -- choosing an engine -----------------------------------------------------------------------------------


def test_choose_engine_names_and_reasons(monkeypatch):
    with pytest.raises(ValueError, match="engine must be one of"):
        choose_engine("fastest")
    assert {"auto", "torch", "numba"} <= set(choices(ENGINES))
    engine, reason = choose_engine("torch")
    assert engine.name == "torch" and reason == "requested"
    monkeypatch.setitem(sys.modules, "ubep.engine.numba_engine", None)  # as if numba were not installed
    engine, reason = choose_engine("auto")
    assert engine.name == "torch" and "numba not installed" in reason
    with pytest.raises(ImportError, match="needs numba"):
        choose_engine("numba")


def test_choose_engine_auto_takes_numba_where_it_compiles():
    pytest.importorskip("numba")
    engine, reason = choose_engine("auto")
    assert engine.name == "numba" and "compiled kernels" in reason


def many_sources(dtype: torch.dtype, width: int, seed: int):
    """Blocks of rows living in separate buffers (as several ranks' memories), with ascending
    token lists per block (a token at most once per block), and the token count N."""
    gen = torch.Generator().manual_seed(seed)
    N, blocks, tokens = 37, [], []
    for s in range(5):
        n = int(torch.randint(0, N + 1, (1,), generator=gen)) if s != 2 else 0  # one empty block
        token_n = torch.sort(torch.randperm(N, generator=gen)[:n]).values
        buffer_XW = random_rows(n + 3, width, dtype, seed * 10 + s)  # rows inside a larger buffer
        blocks.append(buffer_XW[1 : 1 + n])
        tokens.append(token_n)
    return N, blocks, tokens


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width", [3, 7168])
def test_reduce_blocks_sums_each_token_in_block_order(engine, dtype, width):
    N, blocks, tokens = many_sources(dtype, width, seed=width)
    blocks[1][0, 0], blocks[3][-1, 1] = float("inf"), float("nan")  # non-finite values stay in their token
    want = torch.zeros(N, width, dtype=torch.float32)
    for rows_nW, token_n in zip(blocks, tokens, strict=True):  # one row at a time, blocks in order
        for row, t in zip(rows_nW, token_n.tolist(), strict=True):
            want[t] += row.float()
    got = torch.empty(N, width, dtype=dtype)
    engine.reduce_blocks(blocks, tokens, got)
    want = want.to(dtype)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert_same_bits(torch.where(nan, 0, got), torch.where(nan, 0, want))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
def test_gather_blocks_places_every_source_at_its_start(engine, dtype):
    _, blocks, _ = many_sources(torch.uint8 if dtype == torch.float8_e4m3fn else dtype, 33, seed=4)
    blocks = [b.view(dtype) for b in blocks]
    gen = torch.Generator().manual_seed(9)
    indices = [torch.randint(0, max(b.shape[0], 1), (b.shape[0] // 2,), generator=gen) for b in blocks]
    starts, at = [], 2
    for index in indices:
        starts.append(at)
        at += index.numel() + 1  # gaps between blocks stay untouched
    out = torch.zeros(at + 2, 33, dtype=dtype)
    want = out.clone()
    for rows_nW, index, start in zip(blocks, indices, starts, strict=True):
        for i, row in enumerate(index.tolist()):
            want[start + i] = rows_nW[row]
    engine.gather_blocks(blocks, indices, out, starts)
    assert_same_bits(out, want)


def test_localize_blocks_matches_localize_rows_per_source(engine):
    gen = torch.Generator().manual_seed(2)
    local_of_expert_E = torch.tensor([-1, -1, 0, 1, -1, 2, -1, -1])
    topks = [torch.randint(-1, 8, (n, 3), generator=gen) for n in (4, 0, 6)]
    weights = [torch.rand(n, 3, generator=gen) for n in (4, 0, 6)]
    indices = [torch.tensor([0, 2, 3]), torch.tensor([], dtype=torch.int64), torch.tensor([1, 5])]
    got_idx, got_w = torch.empty(5, 3, dtype=torch.int64), torch.empty(5, 3)
    engine.localize_blocks(topks, weights, indices, local_of_expert_E, got_idx, got_w)
    want_idx, want_w, at = torch.empty(5, 3, dtype=torch.int64), torch.empty(5, 3), 0
    for topk_XK, w_XK, index in zip(topks, weights, indices, strict=True):
        for row in index.tolist():
            for k in range(3):
                e = int(topk_XK[row, k])
                local = int(local_of_expert_E[e]) if e >= 0 else -1
                want_idx[at, k], want_w[at, k] = local, float(w_XK[row, k]) if local >= 0 else 0.0
            at += 1
    assert torch.equal(got_idx, want_idx) and torch.equal(got_w, want_w)
    with pytest.raises(BlockIndexError) as row_error:  # block 0 has 4 rows
        engine.localize_blocks(topks, weights, [torch.tensor([4]), indices[1], indices[2]], local_of_expert_E,
                               got_idx[:3], got_w[:3])  # fmt: skip
    assert (row_error.value.block, row_error.value.what) == (0, "row")
    topks[2][5, 1] = 8  # an expert id >= E in block 2's second listed row, after an empty block
    with pytest.raises(BlockIndexError) as expert_error:
        engine.localize_blocks(topks, weights, indices, local_of_expert_E, got_idx, got_w)
    assert (expert_error.value.block, expert_error.value.what) == (2, "expert")

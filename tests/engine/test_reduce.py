"""The combine reduction (each CPU engine's `accumulate_rows`) against a sequential float32
oracle, bit for bit: ordinary rows, and single rows holding Inf, -Inf or NaN (which
must reach only their own token and column); and end to end, a shared-memory combine
with such a row against the reference (once a selection-matrix product made one Inf
NaN for every token: 0 x Inf)."""

from __future__ import annotations

import pytest
import torch
from scenarios import Scenario, expert_output

import ubep
from ubep import reference
from ubep.engine import choose_engine

SPECIALS = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}


def sequential_sum(rows_MH: torch.Tensor, token_M: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """One row at a time, in row order, from +0, in float32; rounded once at the end."""
    out_NH = torch.zeros(num_tokens, rows_MH.shape[1], dtype=torch.float32)
    for j in range(token_M.numel()):
        out_NH[token_M[j]] += rows_MH[j].float()
    return out_NH.to(rows_MH.dtype)


@pytest.fixture(params=["torch", "numba"])
def engine(request):
    """Each CPU engine's kernels (numba skipped where it is not installed)."""
    try:
        return choose_engine(request.param)[0]
    except ImportError as error:
        pytest.skip(str(error))


def engine_sum(engine, rows_MH: torch.Tensor, token_M: torch.Tensor, num_tokens: int) -> torch.Tensor:
    acc_NH = torch.zeros(num_tokens, rows_MH.shape[1], dtype=torch.float32)
    engine.accumulate_rows(acc_NH, rows_MH, token_M)
    return acc_NH.to(rows_MH.dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so NaNs compare equal only when identical."""
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def routed_rows(num_rows: int, num_tokens: int, hidden: int, dtype: torch.dtype, seed: int):
    """Destination-major rows: blocks of ascending tokens, as a combine buffer holds them."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [torch.nonzero(torch.rand(num_tokens, generator=gen) < 0.6).flatten() for _ in range(8)]
    token_M = torch.cat(blocks)[:num_rows]
    rows_MH = (torch.randn(token_M.numel(), hidden, generator=gen) * 4).to(dtype)
    return rows_MH, token_M


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_rows", [0, 1, 31, 32, 33, 150])
def test_sums_match_the_sequential_order(engine, dtype, num_rows):
    N, H = 37, 48
    rows_MH, token_M = routed_rows(num_rows, N, H, dtype, seed=num_rows)
    got = engine_sum(engine, rows_MH, token_M, N)
    assert torch.equal(bits(got), bits(sequential_sum(rows_MH, token_M, N)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("special", ["inf", "-inf", "nan", "inf and -inf"])
def test_non_finite_values_stay_in_their_token_and_column(engine, dtype, special):
    N, H = 20, 16
    rows_MH, token_M = routed_rows(100, N, H, dtype, seed=7)
    hit = [5] if special != "inf and -inf" else [5, int(torch.nonzero(token_M == token_M[5])[-1])]
    for j, name in zip(hit, special.split(" and "), strict=True):
        rows_MH[j, 3] = SPECIALS[name]
    got = engine_sum(engine, rows_MH, token_M, N)
    want = sequential_sum(rows_MH, token_M, N)
    assert torch.equal(bits(got), bits(want))
    bad = ~torch.isfinite(got.float())
    assert bad.sum() == 1 and bad[token_M[5], 3], "exactly one entry is not finite"
    if special == "inf and -inf":
        assert torch.isnan(got[token_M[5], 3])


def test_negative_zero_rows_sum_like_the_reference(engine):
    token_M = torch.tensor([0, 1, 0])
    rows_MH = torch.tensor([[-0.0, -0.0], [-0.0, 1.0], [-0.0, -0.0]], dtype=torch.bfloat16)
    got = engine_sum(engine, rows_MH, token_M, 2)
    assert torch.equal(bits(got), bits(sequential_sum(rows_MH, token_M, 2)))  # +0: the sum starts at +0


def same_values(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit for bit, except that a NaN's sign and payload may differ (NaN where the reference has NaN)."""
    nan = torch.isnan(want)
    return torch.equal(torch.isnan(got), nan) and torch.equal(bits(got)[~nan], bits(want)[~nan])


def combine_with_a_special_row(sc: Scenario, special: str, engine: str) -> tuple[bool, bool]:
    """Every rank: dispatch, make rank 1's first returned row hold `special` in column 2, combine.
    Returns (bit for bit, bit for bit but for NaN payloads) against the reference, on this rank."""
    me = torch.distributed.get_rank()
    xs, idxs, ws, ref = sc.expected()
    ys = [expert_output(ref[r].recv_x_MH, r) for r in range(sc.num_ranks)]
    ys[1][0, 2] = SPECIALS[special]
    want = reference.combine(ys, ref, [x.shape[0] for x in xs])[me]
    with ubep.Buffer(
        hidden=sc.hidden,
        num_experts=sc.num_experts,
        max_tokens_per_rank=sc.capacity,
        protocol=sc.name,
        timeout_s=20,
        engine=engine,
    ) as buf:
        got = buf.dispatch(xs[me], topk_idx=idxs[me], topk_weights=ws[me])
        out = buf.combine(ys[me], got.handle)
    return torch.equal(bits(out.combined_x), bits(want)), same_values(out.combined_x, want)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ["torch", "numba"])
@pytest.mark.parametrize("protocol", ["ubep", "bsp"])
@pytest.mark.parametrize("special", ["inf", "-inf", "nan"])
def test_shared_memory_combine_keeps_one_inf_in_one_place(engine, protocol, special):
    """torch: bit for bit. numba: its NaN comes out as the canonical 0x7FC0 where the reference
    keeps 0xFFFF (sign and payload), everything else bit for bit."""
    if engine == "numba":
        try:
            choose_engine("numba")
        except ImportError as error:
            pytest.skip(str(error))
    sc = Scenario(name=protocol, num_ranks=2, num_experts=8, hidden=32, tokens=(12, 12), seed=5)
    launch = ubep.LocalLaunch(world_size=2, timeout_s=100)
    results = launch.run(combine_with_a_special_row, sc, special, engine)
    exact = [bit_for_bit if engine == "torch" else values for bit_for_bit, values in results]
    assert exact == [True, True], results

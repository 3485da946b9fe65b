"""The combine reduction against a plain float32 index-add, with padded shapes."""

from __future__ import annotations

import pytest
import torch

from ubep.reduce import ROW_QUANTUM, padded_rows, sum_rows_by_token


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_rows", [0, 1, 63, 64, 65, 300])
def test_sums_match_index_add_with_zero_padding(dtype, num_rows):
    gen = torch.Generator().manual_seed(num_rows)
    N, H = 37, 48
    token_M = torch.sort(torch.randint(0, N, (num_rows,), generator=gen)).values
    rows_MH = (torch.randn(num_rows, H, generator=gen) * 4).to(dtype)
    P = padded_rows(num_rows, capacity=10_000)
    rows_PH = torch.cat([rows_MH, torch.zeros(P - num_rows, H, dtype=dtype)])
    want = torch.zeros(N, H).index_add_(0, token_M, rows_MH.float()).to(dtype)
    assert torch.equal(sum_rows_by_token(rows_PH, token_M, N), want)


def test_padding_bounds_the_number_of_shapes():
    capacity = 8 * 128
    shapes = {padded_rows(m, capacity) for m in range(capacity + 1)}
    assert len(shapes) <= capacity // ROW_QUANTUM + 1
    assert all(padded_rows(m, capacity) >= m for m in range(capacity + 1))
    assert padded_rows(capacity, capacity) == capacity

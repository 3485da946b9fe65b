"""The combine reduction: sum the rows that came back for each token, in float32.

Rows arrive destination-major (every row from rank 0, then rank 1, ...), each
block ascending by token. Example, N = 3 tokens, rows from ranks 0 and 1:

    token_M = [0, 2 | 0, 1]      rows_M = [a, b | c, d]
    out     = [a + c, d, b]      (token 0 got rows from both ranks)

Two kernels give the same sums. For 16-bit rows the sum is a product with a
0/1 selection matrix S [N, M] (S[token_M[j], j] = 1): torch's 16-bit matrix
multiply accumulates in float32 and rounds once, and on CPUs with bf16 matrix
units it runs at several times the speed of converting rows to float32 and
index-adding them. Float32 rows are index-added directly, in row order, which
is ascending source rank: the reference's order.

The matrix library compiles a kernel for each new shape (about 40 ms here,
and a cache entry that stays), while M changes with every call's routing. So
shapes are rounded up: M to a multiple of ROW_QUANTUM (the caller zeroes the
extra rows) and N to a multiple of TOKEN_QUANTUM, which bounds the number of
distinct shapes a Buffer ever asks for.
"""

from __future__ import annotations

import torch

HALF_DTYPES = (torch.bfloat16, torch.float16)
ROW_QUANTUM = 64
TOKEN_QUANTUM = 16


def padded_rows(num_rows: int, capacity: int) -> int:
    """Rows to hand to `sum_rows_by_token`: num_rows rounded up to ROW_QUANTUM, at most capacity."""
    return min(-(-num_rows // ROW_QUANTUM) * ROW_QUANTUM, max(capacity, num_rows))


def sum_rows_by_token(rows_PH: torch.Tensor, token_M: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[N, H] in rows' dtype: per token, the float32 sum of its rows (zeros if none).

    rows_PH holds P >= M rows: row j < M belongs to token_M[j]; rows past M only
    pad the shape (see `padded_rows`) and must be zero.
    """
    M = token_M.numel()
    if rows_PH.dtype in HALF_DTYPES and M:
        padded_n = -(-num_tokens // TOKEN_QUANTUM) * TOKEN_QUANTUM
        S_NP = torch.zeros(padded_n, rows_PH.shape[0], dtype=rows_PH.dtype)
        S_NP[token_M, torch.arange(M)] = 1
        return torch.mm(S_NP, rows_PH)[:num_tokens]
    out_NH = torch.zeros(num_tokens, rows_PH.shape[1], dtype=torch.float32)
    out_NH.index_add_(0, token_M, rows_PH[:M].float())
    return out_NH.to(rows_PH.dtype)


def sum_weights_by_token(w_MK: torch.Tensor, token_M: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """float32 [N, K]: per token, the sum of its returned top-k weight rows."""
    out_NK = torch.zeros(num_tokens, w_MK.shape[1], dtype=torch.float32)
    return out_NK.index_add_(0, token_M, w_MK)

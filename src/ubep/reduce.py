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
"""

from __future__ import annotations

import torch

HALF_DTYPES = (torch.bfloat16, torch.float16)


def selection_matrix(token_M: torch.Tensor, num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """S [N, M] with S[token_M[j], j] = 1 and zeros elsewhere."""
    S_NM = torch.zeros(num_tokens, token_M.numel(), dtype=dtype)
    S_NM[token_M, torch.arange(token_M.numel())] = 1
    return S_NM


def sum_rows_by_token(rows_MH: torch.Tensor, token_M: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[N, H] in rows' dtype: per token, the float32 sum of its rows (zeros if none)."""
    if rows_MH.dtype in HALF_DTYPES and rows_MH.shape[0]:
        return torch.mm(selection_matrix(token_M, num_tokens, rows_MH.dtype), rows_MH)
    out_NH = torch.zeros(num_tokens, rows_MH.shape[1], dtype=torch.float32)
    out_NH.index_add_(0, token_M, rows_MH.float())
    return out_NH.to(rows_MH.dtype)


def sum_weights_by_token(w_MK: torch.Tensor, token_M: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """float32 [N, K]: per token, the sum of its returned top-k weight rows."""
    out_NK = torch.zeros(num_tokens, w_MK.shape[1], dtype=torch.float32)
    return out_NK.index_add_(0, token_M, w_MK)

"""Row blocks in shared segments: typed views of byte regions, and the combine
buffer both shared-memory protocols use (rows back, destination-major).

Legend: see `ubep.layout`.
"""

from __future__ import annotations

import torch

from ubep.layout import destination_major
from ubep.reduce import sum_rows_by_token, sum_weights_by_token
from ubep.results import DispatchHandle
from ubep.shm import SymmetricHeap


def rows_view(
    raw: torch.Tensor, rows: int, cols: int, dtype: torch.dtype, first_row: int = 0
) -> torch.Tensor:
    """Rows [first_row, first_row + rows) of a byte region holding [*, cols] `dtype` rows."""
    row_bytes = cols * dtype.itemsize
    return raw[first_row * row_bytes : (first_row + rows) * row_bytes].view(dtype).view(rows, cols)


def put_back(
    heap: SymmetricHeap, region: str, home: int, at: int, rows_nH: torch.Tensor, w_nK: torch.Tensor | None
) -> None:
    """Write expert outputs for `home` into its combine buffer from row `at` on."""
    n, H = rows_nH.shape
    rows_view(heap.tensor(home, f"{region}.x"), n, H, rows_nH.dtype, first_row=at).copy_(rows_nH)
    if w_nK is not None:
        K = w_nK.shape[1]
        heap.tensor(home, f"{region}.w")[at * K : (at + n) * K].copy_(w_nK.flatten())


def reduce_back(
    heap: SymmetricHeap,
    me: int,
    region: str,
    dtype: torch.dtype,
    H: int,
    handle: DispatchHandle,
    K: int | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sum this rank's combine buffer per token: (combined [N, H], weights [N, K] or None)."""
    _, token_M = destination_major(handle.is_token_in_rank_NR)
    rows_MH = rows_view(heap.tensor(me, f"{region}.x"), token_M.numel(), H, dtype)
    out_NH = sum_rows_by_token(rows_MH, token_M, handle.num_tokens)
    if K is None:
        return out_NH, None
    w_MK = heap.tensor(me, f"{region}.w")[: token_M.numel() * K].view(-1, K)
    return out_NH, sum_weights_by_token(w_MK, token_M, handle.num_tokens)

"""The numba engine: the kernel interface compiled, working in place on the tensors' memory.

    protocol -> [engine: numba] -> transport

Each method views its tensors as numpy arrays over the same memory (no copy;
they may lie in a shared segment), checks the layout once, and runs one
compiled kernel from `numba_kernels` with the GIL released. Results are bit
for bit the torch engine's: the same float32 operations in the same order.

A layout the kernels do not take (a non-unit stride along a row, overlapping
destination rows, a dtype other than the contract's, a tensor off the CPU)
goes to the torch engine, which either handles it or raises its own error.
"""

from __future__ import annotations

import numpy as np
import torch

from ubep.engine import numba_kernels as kernels
from ubep.engine.torch_engine import TorchEngine, as_words

ROW_DTYPES = {torch.float32: torch.float32, torch.bfloat16: torch.uint16, torch.float16: torch.int16}
INDEX_DTYPES = (torch.int64, torch.int32)
NO_INDEX = np.empty(0, dtype=np.int64)  # "rows in order" for the copy kernel; never written
NO_WEIGHT_n = np.empty(0, dtype=np.float32)  # placeholders where the kernel is told "no weights"
NO_WEIGHTS_nK = np.empty((0, 0), dtype=np.float32)


def flat_view(t: torch.Tensor) -> np.ndarray | None:
    """The memory `t` spans as a 1-D numpy array (no copy), or None where it is not unit-stride along rows.

    Element (i, j) of a 2-D `t` is then flat[i * t.stride(0) + j] (likewise in 3-D).
    16-bit floats come back as their bits (see `numba_kernels.widen`).
    """
    if t.requires_grad or t.device.type != "cpu" or (t.shape[-1] > 1 and t.stride(-1) != 1):
        return None
    if any(s < 0 for s in t.stride()):
        return None
    span = 0 if t.numel() == 0 else 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    flat = t.as_strided((span,), (1,))
    return flat.view(ROW_DTYPES.get(t.dtype, t.dtype)).numpy()


def rows_disjoint(t_XB: torch.Tensor) -> bool:
    """No two rows of a written matrix share memory."""
    return t_XB.shape[0] <= 1 or t_XB.stride(0) >= t_XB.shape[1]


def index_array(index_n: torch.Tensor) -> np.ndarray | None:
    """An index tensor as numpy (no copy), or None for a dtype or device the kernels do not take."""
    if index_n.dtype not in INDEX_DTYPES or index_n.device.type != "cpu" or index_n.dim() != 1:
        return None
    return index_n.numpy()


def check(bad: int, n: int, first: str, second: str = "") -> None:
    """Raise a kernel's report: position `bad` < n of `first`, or bad - n of `second`, is out of range."""
    if bad != kernels.OK:
        what, pos = (first, bad) if bad < n else (second, bad - n)
        raise IndexError(f"{what}: the index at position {pos} is out of range")


class NumbaEngine:
    """Kernels compiled by numba; see `ubep.engine.base.Engine` for the contract of each."""

    name = "numba"

    def __init__(self) -> None:
        self.fallback = TorchEngine()

    def warm_up(self) -> str:
        """Compile (or load from disk) the common kernels and check them on the docstring examples.

        Returns where the compiled code is cached; raises RuntimeError if a kernel
        gives a wrong answer (numba's own errors pass through).
        """
        rows_X1 = torch.tensor([[1.0], [2.0], [3.0]])
        for dtype in (torch.bfloat16, torch.float32):
            gathered_n1 = torch.empty(2, 1, dtype=dtype)
            self.copy_rows(rows_X1.to(dtype), torch.tensor([2, 0]), gathered_n1, None)
            acc_N1 = torch.zeros(2, 1)
            self.accumulate_rows(acc_N1, rows_X1.to(dtype), torch.tensor([1, 0, 1]), torch.ones(3))
            y_NKH = rows_X1.to(dtype).view(1, 3, 1)
            summed_N1 = self.weighted_sum(y_NKH, torch.tensor([[0.5, 2.0, 1.0]]), torch.tensor([[True] * 3]))
            if gathered_n1.tolist() != [[3.0], [1.0]] or acc_N1.tolist() != [[2.0], [4.0]]:
                raise RuntimeError(f"numba kernels: wrong copy or accumulate for {dtype}")
            if summed_N1.tolist() != [[7.5]]:
                raise RuntimeError(f"numba kernels: wrong weighted_sum for {dtype}")
        local_nK = torch.empty(1, 3, dtype=torch.int64)
        weights_nK = torch.empty(1, 3)
        topk_XK, local_of_expert_E = torch.tensor([[3, 0, -1]]), torch.tensor([-1, -1, 0, 1])
        self.localize_rows(
            topk_XK, torch.ones(1, 3), torch.tensor([0]), local_of_expert_E, local_nK, weights_nK
        )
        if local_nK.tolist() != [[1, -1, -1]] or weights_nK.tolist() != [[1.0, 0.0, 0.0]]:
            raise RuntimeError("numba kernels: wrong localize_rows")
        where = kernels.cache_dir(kernels.copy_rows)
        return f"cached in {where}" if where else "no writable cache directory: compiled in this process"

    def copy_rows(
        self,
        src_XB: torch.Tensor,
        src_index_n: torch.Tensor | None,
        dst_YB: torch.Tensor,
        dst_index_n: torch.Tensor | None,
    ) -> None:
        src_w, dst_w = as_words(src_XB, dst_YB)
        n = next((i.numel() for i in (src_index_n, dst_index_n) if i is not None), src_w.shape[0])
        src = flat_view(src_w)
        dst = flat_view(dst_w) if rows_disjoint(dst_w) else None
        src_i = NO_INDEX if src_index_n is None else index_array(src_index_n)
        dst_i = NO_INDEX if dst_index_n is None else index_array(dst_index_n)
        shapes_ok = (
            src_w.shape[1] == dst_w.shape[1]
            and (src_index_n is not None or src_w.shape[0] == n)
            and (dst_index_n is not None or dst_w.shape[0] >= n)
            and (src_index_n is None or dst_index_n is None or dst_index_n.numel() == n)
        )
        if src is None or dst is None or src_i is None or dst_i is None or not shapes_ok:
            return self.fallback.copy_rows(src_XB, src_index_n, dst_YB, dst_index_n)
        if n == 0 or src_w.shape[1] == 0:
            return None
        src_rows, width = src_w.shape
        bad = kernels.copy_rows(
            src, src_w.stride(0), src_rows, src_i, dst, dst_w.stride(0), dst_w.shape[0], dst_i, n, width
        )
        check(bad, n, "copy_rows: src_index", "copy_rows: dst_index")

    def localize_rows(
        self,
        topk_XK: torch.Tensor,
        weights_XK: torch.Tensor | None,
        rows_n: torch.Tensor,
        local_of_expert_E: torch.Tensor,
        out_idx_nK: torch.Tensor,
        out_weights_nK: torch.Tensor | None,
    ) -> None:
        with_weights = out_weights_nK is not None
        ints = [topk_XK, rows_n, local_of_expert_E, out_idx_nK]
        floats = [weights_XK, out_weights_nK] if with_weights else []
        supported = (
            all(t.device.type == "cpu" and not t.requires_grad for t in ints + floats)
            and all(t.dtype in INDEX_DTYPES for t in ints)
            and all(t.dtype == torch.float32 for t in floats)
            and rows_n.dim() == 1
            and out_idx_nK.shape == (rows_n.numel(), topk_XK.shape[1])
            and (not with_weights or weights_XK.shape == topk_XK.shape)
            and (not with_weights or out_weights_nK.shape == out_idx_nK.shape)
        )
        if not supported:
            return self.fallback.localize_rows(
                topk_XK, weights_XK, rows_n, local_of_expert_E, out_idx_nK, out_weights_nK
            )
        bad = kernels.localize_rows(
            topk_XK.numpy(),
            rows_n.numpy(),
            local_of_expert_E.numpy(),
            out_idx_nK.numpy(),
            weights_XK.numpy() if with_weights else NO_WEIGHTS_nK,
            out_weights_nK.numpy() if with_weights else NO_WEIGHTS_nK,
            with_weights,
        )
        n = rows_n.numel()
        check(bad, n, "localize_rows: rows_n", "localize_rows: the expert id in topk_XK, for row")

    def accumulate_rows(
        self,
        acc_NH: torch.Tensor,
        rows_nH: torch.Tensor,
        token_n: torch.Tensor,
        weight_n: torch.Tensor | None = None,
    ) -> None:
        n = token_n.numel()
        acc = flat_view(acc_NH) if acc_NH.dtype == torch.float32 and rows_disjoint(acc_NH) else None
        rows = flat_view(rows_nH) if rows_nH.dtype in ROW_DTYPES else None
        token = index_array(token_n)
        weight_ok = weight_n is None or (
            weight_n.dtype == torch.float32 and weight_n.shape == (n,) and weight_n.device.type == "cpu"
        )
        shapes_ok = acc_NH.dim() == rows_nH.dim() == 2 and rows_nH.shape == (n, acc_NH.shape[1])
        if acc is None or rows is None or token is None or not weight_ok or not shapes_ok:
            return self.fallback.accumulate_rows(acc_NH, rows_nH, token_n, weight_n)
        if n == 0:
            return None
        weight = NO_WEIGHT_n if weight_n is None else weight_n.detach().numpy()
        bad = kernels.accumulate_rows(
            acc, acc_NH.stride(0), acc_NH.shape[0], rows, rows_nH.stride(0), token, weight,
            weight_n is not None, acc_NH.shape[1],
        )  # fmt: skip
        check(bad, n, "accumulate_rows: token_n")

    def weighted_sum(self, y_NKH: torch.Tensor, w_NK: torch.Tensor, valid_NK: torch.Tensor) -> torch.Tensor:
        y = flat_view(y_NKH) if y_NKH.dtype in ROW_DTYPES and y_NKH.dim() == 3 else None
        N, K, H = y_NKH.shape if y_NKH.dim() == 3 else (0, 0, 0)
        supported = (
            y is not None
            and w_NK.dtype == torch.float32
            and valid_NK.dtype == torch.bool
            and w_NK.shape == valid_NK.shape == (N, K)
            and not w_NK.requires_grad
        )
        if not supported:
            return self.fallback.weighted_sum(y_NKH, w_NK, valid_NK)
        out_NH = torch.empty(N, H, dtype=torch.float32)
        kernels.weighted_sum(
            y, y_NKH.stride(0), y_NKH.stride(1), w_NK.numpy(), valid_NK.numpy(), out_NH.numpy(), H
        )
        return out_NH

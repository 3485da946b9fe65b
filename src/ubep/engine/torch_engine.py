"""The torch engine: the portable kernels, and the readable statement of what each computes.

Every other engine is tested against this one (and this one against
`ubep.reference`). It runs wherever torch runs; its costs are per-op dispatch
and temporaries, which the compiled engines avoid.
"""

from __future__ import annotations

import torch

from ubep import reference
from ubep.engine.base import PerBlock
from ubep.registry import TORCH

WORD_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def as_words(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The same bytes viewed as the widest integer type every tensor allows (rows copied bitwise).

    Row copies index element by element, so copying 8-byte words instead of
    bytes is several times faster; all views share one type so copies stay bitwise.
    """
    raw = tuple(t if t.dtype == torch.uint8 else t.view(torch.uint8) for t in tensors)
    for dtype in WORD_DTYPES:
        try:
            return tuple(t.view(dtype) for t in raw)
        except RuntimeError:
            continue
    raise AssertionError("uint8 views always exist")


class TorchEngine(PerBlock):
    """Kernels as torch ops; see `ubep.engine.base.Engine` for the contract of each."""

    name = TORCH.name

    def copy_rows(
        self,
        src_XB: torch.Tensor,
        src_index_n: torch.Tensor | None,
        dst_YB: torch.Tensor,
        dst_index_n: torch.Tensor | None,
    ) -> None:
        src_w, dst_w = as_words(src_XB, dst_YB)
        if dst_index_n is None:
            n = src_w.shape[0] if src_index_n is None else src_index_n.numel()
            if src_index_n is None:
                dst_w[:n].copy_(src_w)
            elif n:
                torch.index_select(src_w, 0, src_index_n, out=dst_w[:n])
        elif dst_index_n.numel():
            dst_w[dst_index_n] = src_w if src_index_n is None else src_w[src_index_n]

    def localize_rows(
        self,
        topk_XK: torch.Tensor,
        weights_XK: torch.Tensor | None,
        rows_n: torch.Tensor,
        local_of_expert_E: torch.Tensor,
        out_idx_nK: torch.Tensor,
        out_weights_nK: torch.Tensor | None,
    ) -> None:
        idx_nK = topk_XK[rows_n]
        local_nK = torch.where(idx_nK >= 0, local_of_expert_E[idx_nK.clamp(min=0)], -1)
        out_idx_nK.copy_(local_nK)
        if out_weights_nK is not None:
            out_weights_nK.copy_(torch.where(local_nK >= 0, weights_XK[rows_n], 0.0))

    def accumulate_rows(
        self,
        acc_NH: torch.Tensor,
        rows_nH: torch.Tensor,
        token_n: torch.Tensor,
        weight_n: torch.Tensor | None = None,
    ) -> None:
        if token_n.numel() == 0:
            return
        rows = rows_nH.float()
        if weight_n is not None:
            rows = rows * weight_n.unsqueeze(1)
        acc_NH.index_add_(0, token_n, rows)

    def weighted_sum(self, y_NKH: torch.Tensor, w_NK: torch.Tensor, valid_NK: torch.Tensor) -> torch.Tensor:
        return reference.weighted_sum(y_NKH, w_NK, valid_NK)

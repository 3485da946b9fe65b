"""Normal mode's combine in torch, the readable statement of the compiled halves and their test
oracle: each expert rank publishes its output rows once (`publish_back`); each home pulls its block
from every expert rank and reduces (`reduce_home`). The ubep protocol runs it as it is; bsp between
its barriers.

Legend: see `ubep.layout`.
"""

from __future__ import annotations

import numpy as np
import torch

from ubep.calls import CallId
from ubep.engine import Engine
from ubep.protocols.base import CODE_DTYPES, DTYPE_CODES, rows, send_tokens, spread
from ubep.protocols.combine.blocks import BackBlocks
from ubep.results import DispatchHandle
from ubep.transport.base import Transport


def publish_back(
    t: Transport,
    blocks: BackBlocks,
    call: CallId,
    x_MH: torch.Tensor,
    handle: DispatchHandle,
    topk_weights_MK: torch.Tensor | None,
) -> None:
    """An expert rank's half of combine: its output rows (and weights) out once, then the stamp."""
    M, H = x_MH.shape
    rows(t.view(blocks.y, t.rank, call), M, x_MH.dtype, H).copy_(x_MH)
    K = 0 if topk_weights_MK is None else topk_weights_MK.shape[1]
    if K:
        t.view(blocks.y_weights, t.rank, call)[:M, :K].copy_(topk_weights_MK)
    values = {
        "dtype": DTYPE_CODES[x_MH.dtype],
        "topk": K,
        "prefix": handle.recv_prefix_R1.tolist(),
        "dispatch": handle.seq,
    }
    t.publish(blocks.back, call, values)


def reduce_home(
    t: Transport,
    engine: Engine,
    blocks: BackBlocks,
    call: CallId,
    handle: DispatchHandle,
    x_MH: torch.Tensor,
    topk_weights_MK: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The home's half of combine, once every live expert rank's block has landed: check them all,
    then pull every block once and sum each token's rows in float32, in ascending rank order
    (the reference's), rounding once into x's dtype.

    Returns (combined [N, H] in x's dtype, summed weights float32 [N, K] or None).
    """
    dtype, H = x_MH.dtype, x_MH.shape[1]
    K = 0 if topk_weights_MK is None else topk_weights_MK.shape[1]
    N, me = handle.num_tokens, t.rank
    tokens = send_tokens(handle.is_token_in_rank_NR, handle.send_counts_R)
    got = spread(t.read_all(blocks.back, call, t.live), t.live, t.num_ranks)
    live_R = np.isin(np.arange(t.num_ranks), t.live)
    begin_R, end_R = got["prefix"][:, me], got["prefix"][:, me + 1]
    expected_R = np.array([tok.numel() for tok in tokens])
    other = np.flatnonzero((got["dispatch"] != handle.seq) & live_R)
    if other.size:
        r = int(other[0])
        message = (
            f"combine: rank {r} combines the rows of call #{got['dispatch'][r]}, this rank those of "
            f"#{handle.seq} (all ranks must pass the handle of the same dispatch)"
        )
        raise t.bad_data(call, r, message)
    formats_R = (got["dtype"] != DTYPE_CODES[dtype]) | (got["topk"] != K)
    wrong = (end_R - begin_R != expected_R) | (formats_R & live_R)
    if wrong.any():
        r = int(np.flatnonzero(wrong)[0])
        sent = CODE_DTYPES.get(int(got["dtype"][r]))
        message = (
            f"combine: rank {r} returned {end_R[r] - begin_R[r]} rows of {sent} "
            f"(top-k {got['topk'][r]}), expected {expected_R[r]} of {dtype} (top-k {K})"
        )
        raise t.bad_data(call, r, message)
    rows_at = list(zip(begin_R.tolist(), end_R.tolist(), strict=True))
    out_NH = torch.empty(N, H, dtype=dtype, device=x_MH.device)
    x_blocks = [rows(t.view(blocks.y, r, call), z - a, dtype, H, first=a) for r, (a, z) in enumerate(rows_at)]
    engine.reduce_blocks(x_blocks, tokens, out_NH)
    if not K:
        return out_NH, None
    out_NK = torch.empty(N, K, dtype=torch.float32, device=x_MH.device)
    w_blocks = [t.view(blocks.y_weights, r, call)[a:z, :K] for r, (a, z) in enumerate(rows_at)]
    engine.reduce_blocks(w_blocks, tokens, out_NK)
    return out_NH, out_NK

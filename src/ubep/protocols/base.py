"""What every protocol shares: the exchange interface, the send plan and what a
dispatch receives, and the combine's home half (pull and reduce), which the
ubep and bsp protocols run alike.

Legend: see `ubep.layout`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import torch

from ubep import fp8
from ubep.calls import CallId
from ubep.engine import Engine
from ubep.layout import ExpertPlacement, destination_major
from ubep.results import DispatchHandle, RecvRoute
from ubep.transport.base import Field, Header, Record, Region, Transport

# Wire codes for the dtypes a payload may carry (stored next to the data).
DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float8_e4m3fn: 4, torch.uint8: 5}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
MAX_ITEMSIZE = 4  # bytes per element of the widest payload dtype (float32)
CODE_RANGE = (min(CODE_DTYPES), max(CODE_DTYPES))


@dataclass(frozen=True, slots=True)
class SendPlan:
    """The sender's side of one dispatch, from the layout.

    An FP8 payload is two planes, values (`x_NH`, e4m3) and `scales_NS` (float32,
    S = H // 128), moved apart on a heap into their own outputs; the collective
    paths, which move one tensor, pack them into byte rows (`packed_rows`).
    """

    x_NH: torch.Tensor
    topk_idx_NK: torch.Tensor | None  # None: cached dispatch (routing from the handle)
    topk_weights_NK: torch.Tensor | None
    is_token_in_rank_NR: torch.Tensor
    send_counts_R: torch.Tensor  # int64 [R]
    scales_NS: torch.Tensor | None = None  # FP8 scales; None for bf16 / fp32 payloads
    # > 0: every receive output has this many rows (padding after the rows received), so a device
    # dispatch learns its receive size without reading a count on the host (DeepEP's num_worst_tokens)
    num_worst_tokens: int = 0
    # True (the Triton halves, `UbepDevice.layout_by_send`): is_token_in_rank_NR and send_counts_R are
    # outputs, which the send half fills from topk_idx_NK after checking its values (no host read)
    layout_by_send: bool = False

    def send_tokens(self) -> tuple[torch.Tensor, ...]:
        """Per destination rank, the ascending indices of the tokens it gets."""
        return send_tokens(self.is_token_in_rank_NR, self.send_counts_R)

    def packed_rows(self) -> torch.Tensor:
        """The payload as one tensor of rows: x itself, or FP8 values then scales as byte rows."""
        return self.x_NH if self.scales_NS is None else fp8.to_rows(self.x_NH, self.scales_NS)


@dataclass(frozen=True, slots=True)
class Received:
    """The receiver's side of one dispatch; rows in source-rank-then-token order."""

    recv_x_MH: torch.Tensor
    recv_topk_idx_MK: torch.Tensor | None
    recv_topk_weights_MK: torch.Tensor | None
    route: RecvRoute
    recv_scales_MS: torch.Tensor | None = None  # FP8 scales, beside recv_x_MH's values
    rows_per_expert_L: np.ndarray | None = None  # rows each local expert got, where the protocol counted them

    def padded(self, rows: int) -> Received:
        """This result with every output `rows` rows long (num_worst_tokens): the rows received,
        then padding (recv_x and scales 0, top-k ids -1, weights 0). A device dispatch pads in its
        kernels already, and this returns it as it is (shapes only: nothing read on the host)."""
        M = self.recv_x_MH.shape[0]
        if M > rows:
            raise more_than_worst(M, rows)
        if M == rows:
            return self

        def pad(t: torch.Tensor | None, value: float) -> torch.Tensor | None:
            return None if t is None else torch.cat([t, t.new_zeros(rows - M, *t.shape[1:]).fill_(value)])

        return replace(
            self,
            recv_x_MH=pad(self.recv_x_MH, 0),
            recv_topk_idx_MK=pad(self.recv_topk_idx_MK, -1),
            recv_topk_weights_MK=pad(self.recv_topk_weights_MK, 0),
            recv_scales_MS=pad(self.recv_scales_MS, 0),
        )

    @classmethod
    def unpacking(cls, plan: SendPlan, rows_MX: torch.Tensor, *rest) -> Received:
        """What `packed_rows` rows became on arrival, split back into planes where FP8."""
        if plan.scales_NS is None:
            return cls(rows_MX, *rest)
        values_MH, scales_MS = fp8.from_rows(rows_MX, plan.x_NH.shape[1])
        return cls(values_MH, *rest, recv_scales_MS=scales_MS)


def more_than_worst(rows: int, num_worst_tokens: int) -> ValueError:
    """A dispatch received more rows than its num_worst_tokens allows (every engine's words)."""
    return ValueError(
        f"dispatch: this rank receives {rows} rows, more than num_worst_tokens={num_worst_tokens}; "
        "pass at least num_tokens * num_ranks"
    )


class Exchange(Protocol):
    """A protocol bound to a transport: the two halves of an EP layer's traffic.

    Exchanges over a heap also take `mask(ranks, seq) -> seq` (`Transport.mask`): later calls
    leave masked ranks out.
    """

    name: str

    def dispatch(self, call: CallId, plan: SendPlan, handle: DispatchHandle | None) -> Received: ...

    def combine(
        self, call: CallId, x_MH: torch.Tensor, handle: DispatchHandle, topk_weights_MK: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def abort(self, call: CallId) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class Sizing:
    """Shapes every rank agreed on at construction."""

    hidden: int
    capacity: int  # T: most tokens a rank passes to one call
    max_topk: int
    placement: ExpertPlacement

    @property
    def num_ranks(self) -> int:
        return self.placement.num_ranks

    @property
    def row_bytes(self) -> int:
        return self.hidden * MAX_ITEMSIZE


def send_tokens(is_token_in_rank_NR: torch.Tensor, send_counts_R: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per destination rank, the ascending indices of the tokens it gets (an all-to-all's send order)."""
    _, token_n = destination_major(is_token_in_rank_NR)
    return torch.split(token_n, send_counts_R.tolist())


def rows(region_XB: torch.Tensor, n: int, dtype: torch.dtype, width: int, first: int = 0) -> torch.Tensor:
    """Rows [first, first + n) of a byte region holding packed [*, width] rows of `dtype`.

    The region's declared row size B is the widest dtype's; narrower rows are
    packed (row i at byte i * width * itemsize), so every view is contiguous.
    """
    row_bytes = width * dtype.itemsize
    flat = region_XB.view(-1)
    return flat[first * row_bytes : (first + n) * row_bytes].view(dtype).view(n, width)


@dataclass(frozen=True, slots=True)
class BackBlocks:
    """Combine memory: each expert rank's output rows, in the order it received them, and a header
    with the boundaries of each home's block (`prefix`, its recv_prefix_R1)."""

    back: Header
    y: Region  # uint8 [R * T, row bytes]
    y_weights: Region  # float32 [R * T, max_topk]

    @classmethod
    def of(cls, prefix: str, s: Sizing, double: bool) -> BackBlocks:
        R, T, K = s.num_ranks, s.capacity, s.max_topk
        fields = (
            Field("dtype", lo=CODE_RANGE[0], hi=CODE_RANGE[1]),
            Field("topk", hi=K),
            Field("prefix", length=R + 1, hi=R * T),
            Field("dispatch"),  # the seq of the dispatch whose handle this combine uses
        )
        return cls(
            Header(f"{prefix}.back", fields, double=double),
            Region(f"{prefix}.y", (R * T, s.row_bytes), torch.uint8, double=double),
            Region(f"{prefix}.y_weights", (R * T, K), torch.float32, double=double),
        )


def spread(record: Record, peers: Sequence[int], num_ranks: int) -> dict[str, np.ndarray]:
    """`read_all`'s rows for `peers`, each moved to its rank's row of `num_ranks`; the rows of ranks
    not read (masked ones) are zero: no tokens, no rows."""
    out = {}
    for name, rows_P in record.items():
        out[name] = np.zeros((num_ranks, *rows_P.shape[1:]), dtype=rows_P.dtype)
        out[name][list(peers)] = rows_P
    return out


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
    out_NH = torch.empty(N, H, dtype=dtype)
    x_blocks = [rows(t.view(blocks.y, r, call), z - a, dtype, H, first=a) for r, (a, z) in enumerate(rows_at)]
    engine.reduce_blocks(x_blocks, tokens, out_NH)
    if not K:
        return out_NH, None
    out_NK = torch.empty(N, K, dtype=torch.float32)
    w_blocks = [t.view(blocks.y_weights, r, call)[a:z, :K] for r, (a, z) in enumerate(rows_at)]
    engine.reduce_blocks(w_blocks, tokens, out_NK)
    return out_NH, out_NK

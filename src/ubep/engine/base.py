"""The kernel interface: the few data-movement operations every protocol is made of.

    routing -> layout -> schedule -> protocol -> [engine] -> transport

A protocol decides *what* moves *when*; an engine moves and reduces rows. Every
operation works on tensors that may be views of a peer's memory (a shared
segment, a virtual rank's arena, a CUDA peer buffer): the transport hands out
the views, the engine never knows where they live.

Rows are moved as raw words: a row of `B` bytes is viewed as `B // 8` int64
(or narrower) words, so bf16, fp32 and FP8 values or scales take one path.
Reductions read typed rows (bf16, fp16 or fp32) and accumulate in float32 in
the order the rows are given, which is the reference's order (ascending
source rank, then row), so results agree bit for bit with `ubep.reference`.

Legend: see `ubep.layout`; here n counts rows moved by one call, X rows in a
source region.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch


class BlockIndexError(IndexError):
    """An index out of range in one block of `localize_blocks`, named so that a caller blames the
    block's owner from this error alone, without reading the block again (a racing writer could
    have changed it): `block` is its position in the sequences; `what` is "row" (an index that is
    not a row of its block) or "expert" (an expert id >= E)."""

    def __init__(self, block: int, what: str):
        said = "an index that is not a row of it" if what == "row" else "an expert id out of range"
        super().__init__(f"localize_blocks: block {block} holds {said}")
        self.block, self.what = block, what


class Engine(Protocol):
    """One implementation of the kernels (`torch`, `numba`, `triton`). Engines subclass it, so the
    optional parts below keep their defaults where an engine has none of its own."""

    name: str
    # The compiled check-and-layout of a routing (numba's `route`), or None: the Buffer's planner then
    # checks topk_idx and derives the layout in torch.
    route: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    # The compiled plans of low-latency mode (numba's `ll_pairs`, `ll_owners`, `ll_returns`), or None:
    # `ubep.protocols.ll.plans` then checks and orders in torch.
    ll_pairs: Callable[..., tuple[torch.Tensor, ...]] | None = None
    ll_owners: Callable[..., tuple[torch.Tensor, ...]] | None = None
    ll_returns: Callable[..., tuple[torch.Tensor, ...]] | None = None

    def kernels_origin(self) -> str | None:
        """Where this process's compiled kernels came from (numba's disk cache), or None."""
        return None

    def copy_rows(
        self,
        src_XB: torch.Tensor,
        src_index_n: torch.Tensor | None,
        dst_YB: torch.Tensor,
        dst_index_n: torch.Tensor | None,
    ) -> None:
        """dst[dst_index[i]] = src[src_index[i]] for every i, bitwise (rows of equal byte width).

        A None index means "rows in order" (i itself). Destination indices are
        distinct. Example: src rows [a, b, c], src_index [2, 0], dst_index None
        -> dst [c, a] (a gather); src_index None, dst_index [1, 0] -> dst [b, a].
        """

    def gather_blocks(
        self,
        sources: Sequence[torch.Tensor],
        indices: Sequence[torch.Tensor],
        out_MB: torch.Tensor,
        starts: Sequence[int],
    ) -> None:
        """For every source s: out[starts[s] + i] = sources[s][indices[s][i]], bitwise.

        One call moves rows from several sources (several ranks' memory), e.g.
        every source whose payload has landed. Example: sources [[a, b], [c, d]],
        indices [[1], [0, 1]], starts [0, 1] -> out [b, c, d].
        """

    def localize_blocks(
        self,
        topks: Sequence[torch.Tensor],
        weights: Sequence[torch.Tensor],
        indices: Sequence[torch.Tensor],
        local_of_expert_E: torch.Tensor,
        out_idx_MK: torch.Tensor,
        out_weights_MK: torch.Tensor,
    ) -> None:
        """`localize_rows` for several sources at once, their rows one after another in the outputs.

        Source s's rows `indices[s]` of `topks[s]` and `weights[s]` fill the next
        len(indices[s]) rows of out_idx and out_weights. `BlockIndexError` naming the
        first bad block where an index is not a row of its source or an expert id is >= E.
        """

    def localize_rows(
        self,
        topk_XK: torch.Tensor,
        weights_XK: torch.Tensor | None,
        rows_n: torch.Tensor,
        local_of_expert_E: torch.Tensor,
        out_idx_nK: torch.Tensor,
        out_weights_nK: torch.Tensor | None,
    ) -> None:
        """A receiver's view of routing rows `rows` of a source's top-k (global expert ids).

        out_idx[i, k] = local_of_expert[topk[rows[i], k]] (-1 where the expert is
        not on this rank or the slot is -1); out_weights keeps the weight where
        the expert is local and 0 elsewhere. Example (this rank owns experts 2, 3
        as local 0, 1): topk row [3, 0, -1] -> [1, -1, -1].
        """

    def accumulate_rows(
        self,
        acc_NH: torch.Tensor,
        rows_nH: torch.Tensor,
        token_n: torch.Tensor,
        weight_n: torch.Tensor | None = None,
    ) -> None:
        """acc[token[i]] += rows[i] (times weight[i] when given), in float32, i ascending.

        acc is float32 [N, H]; rows are bf16, fp16 or fp32. Inf and NaN propagate
        as in float32 arithmetic (a NaN row poisons only its own token).
        Example: acc zeros [2, H], rows [a, b, c], token [1, 0, 1] -> acc [b, a + c].
        """

    def reduce_blocks(
        self, blocks: Sequence[torch.Tensor], tokens: Sequence[torch.Tensor], out_NH: torch.Tensor
    ) -> None:
        """out[t] = the float32 sum, over s ascending, of the row of blocks[s] whose tokens[s] entry is t,
        rounded once into out's dtype (zeros where no block holds t).

        Each tokens[s] ascends (a token has at most one row per block); blocks may
        live in different ranks' memory. Every row is read once and every output
        row written once. Example: blocks [[a, b], [c]], tokens [[0, 2], [0]]
        -> out [a + c, 0, b].
        """

    def weighted_sum(self, y_NKH: torch.Tensor, w_NK: torch.Tensor, valid_NK: torch.Tensor) -> torch.Tensor:
        """float32 [N, H]: sum over k ascending of w[n, k] * y[n, k] where valid.

        The formula of `ubep.reference.weighted_sum` (the low-latency combine).
        """


class PerBlock(Engine):
    """The several-source kernels composed from the one-source ones, block by block, in order.

    Engines without kernels of their own for several sources (the torch engine,
    the Triton engine) take these; the results are the same by construction:
    `reduce_blocks` adds each block into a float32 accumulator in block order
    and rounds once at the end.
    """

    def gather_blocks(
        self,
        sources: Sequence[torch.Tensor],
        indices: Sequence[torch.Tensor],
        out_MB: torch.Tensor,
        starts: Sequence[int],
    ) -> None:
        for src_XB, index_n, start in zip(sources, indices, starts, strict=True):
            self.copy_rows(src_XB, index_n, out_MB[start : start + index_n.numel()], None)

    def localize_blocks(
        self,
        topks: Sequence[torch.Tensor],
        weights: Sequence[torch.Tensor],
        indices: Sequence[torch.Tensor],
        local_of_expert_E: torch.Tensor,
        out_idx_MK: torch.Tensor,
        out_weights_MK: torch.Tensor,
    ) -> None:
        at, E = 0, local_of_expert_E.numel()
        for s, (topk_XK, weights_XK, index_n) in enumerate(zip(topks, weights, indices, strict=True)):
            n = index_n.numel()
            if n and (int(index_n.min()) < 0 or int(index_n.max()) >= topk_XK.shape[0]):
                raise BlockIndexError(s, "row")
            if n and int(topk_XK[index_n].max()) >= E:  # a kernel need not check its reads (Triton)
                raise BlockIndexError(s, "expert")
            out_idx, out_w = out_idx_MK[at : at + n], out_weights_MK[at : at + n]
            try:
                self.localize_rows(topk_XK, weights_XK, index_n, local_of_expert_E, out_idx, out_w)
            except IndexError:  # the block changed since the check above (a peer still writing it)
                raise BlockIndexError(s, "expert") from None
            at += n

    def reduce_blocks(
        self, blocks: Sequence[torch.Tensor], tokens: Sequence[torch.Tensor], out_NH: torch.Tensor
    ) -> None:
        acc_NH = torch.zeros(out_NH.shape, dtype=torch.float32, device=out_NH.device)
        for rows_nH, token_n in zip(blocks, tokens, strict=True):
            if token_n.numel():
                self.accumulate_rows(acc_NH, rows_nH, token_n)
        out_NH.copy_(acc_NH)

"""The numba engine: the kernel interface compiled, working in place on the tensors' memory.

    protocol -> [engine: numba] -> transport

Each method views its tensors as numpy arrays over the same memory (no copy;
they may lie in a shared segment) and runs one compiled kernel from
`numba_kernels` with the GIL released. Results are bit for bit the torch
engine's: the same float32 operations in the same order.

Whatever the kernels do not take goes to the torch engine, which either handles
it or raises its own error: a dtype or shape outside the contract, a tensor
numpy cannot view (off the CPU, requiring grad), a row that is not unit-stride,
destination rows that overlap. The Python here is kept to a few microseconds a
call: layouts are checked inside the kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial

import numpy as np
import torch

from ubep import validate
from ubep.engine import compile_once
from ubep.engine import numba_kernels as kernels
from ubep.engine.base import BlockIndexError, Engine
from ubep.engine.torch_engine import TorchEngine
from ubep.registry import NUMBA

BITS = {torch.bfloat16: torch.uint16, torch.float16: torch.int16}  # numba has no 16-bit floats
ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int64, torch.int32)
NOT_VIEWABLE = (TypeError, RuntimeError)  # what `Tensor.numpy()` raises off the CPU or with grad
NO_INDEX = np.empty(0, dtype=np.int64)  # "rows in order" for the copy kernel; never written
NO_WEIGHT_n = np.empty(0, dtype=np.float32)  # placeholders where a kernel is told "no weights"
NO_WEIGHTS_nK = np.empty((0, 0), dtype=np.float32)


def array(t: torch.Tensor) -> np.ndarray:
    """t as a numpy array over the same memory (16-bit floats as their bits); NOT_VIEWABLE errors pass."""
    bits = BITS.get(t.dtype)
    return (t if bits is None else t.view(bits)).numpy()


def tensors(*arrays: np.ndarray) -> tuple[torch.Tensor, ...]:
    """Tensors over numpy arrays' memory, for arrays a kernel filled: no copy (torch.empty and .numpy()
    cost several times np.empty and this on a decode-size call; one call wraps them all). An empty
    array gets a fresh tensor instead: numpy gives it zero strides, which torch's dtype views refuse."""
    out = []
    for a in arrays:
        t = torch.from_numpy(a)
        out.append(t if a.size else torch.empty(t.shape, dtype=t.dtype, device="cpu"))
    return tuple(out)


def is_index(index_n: torch.Tensor | None) -> bool:
    return index_n is None or (index_n.dtype in INDEX_DTYPES and index_n.dim() == 1)


def launch(kernel: Callable[..., int], *args) -> int:
    """Run a kernel on numpy views of its tensor arguments (others pass as they are; None: NO_INDEX).

    UNSUPPORTED where numpy cannot view one of the tensors.
    """
    try:
        views = [array(a) if isinstance(a, torch.Tensor) else NO_INDEX if a is None else a for a in args]
    except NOT_VIEWABLE:
        return kernels.UNSUPPORTED
    return kernel(*views)


def check(bad: int, n: int, first: str, second: str = "") -> None:
    """Raise a kernel's report: position `bad` < n of `first`, or bad - n of `second`, is out of range."""
    if bad >= 0:
        what, pos = (first, bad) if bad < n else (second, bad - n)
        raise IndexError(f"{what}: the index at position {pos} is out of range")


def _i64(values: list) -> torch.Tensor:
    """An int64 example tensor on the CPU, whatever torch's defaults: the kernels' check examples."""
    return torch.tensor(values, dtype=torch.int64, device="cpu")


def _f32(values: list) -> torch.Tensor:
    """A float32 example tensor on the CPU, whatever torch's defaults."""
    return torch.tensor(values, dtype=torch.float32, device="cpu")


class NoFallback:
    """Stands in for the torch engine while warming up: the compiled path must take every example."""

    def __getattr__(self, kernel: str):
        raise RuntimeError(f"numba kernels: {kernel} did not take its warm-up example")


TOPK_LIKE = np.empty(0, dtype=np.int64)  # the element type of top-k rows, for kernels that read by address


def _concatenated(indices: Sequence[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """(prefix [S + 1], all indices one after another as int64 numpy)."""
    prefix_S1 = np.zeros(len(indices) + 1, dtype=np.int64)
    np.cumsum([i.numel() for i in indices], out=prefix_S1[1:])
    return prefix_S1, torch.cat([i if i.dtype == torch.int64 else i.to(torch.int64) for i in indices]).numpy()


def _raise_verdict(verdict: int, topk_idx_NK: torch.Tensor, num_experts: int, found: np.ndarray) -> None:
    """Raise a routing kernel's BAD_EXPERT or REPEATED verdict in `ubep.validate`'s words."""
    if verdict == kernels.BAD_EXPERT:
        raise validate.bad_expert(num_experts, int(found[0]))
    if verdict == kernels.REPEATED:
        raise validate.repeated_expert(topk_idx_NK, int(found[0]))


class NumbaEngine(Engine):
    """Kernels compiled by numba; see `ubep.engine.base.Engine` for the contract of each."""

    name = NUMBA.name

    def __init__(self) -> None:
        self.fallback = TorchEngine()

    def warm_up(
        self,
        deadline: float | None = None,
        halves: Mapping[str, Callable[[Engine], None]] | None = None,
        examples: bool = False,
    ) -> str:
        """Compile (once per host: `compile_once`) or load the kernels and check them on the
        docstring examples, then run each of `halves` (warm-ups of the call halves, by name) on
        this engine. The examples run where the kernels compile, and where the cache has changed
        since it was last read back; elsewhere only with `examples` (`ubep warm`): the kernels
        they do not share with the halves then load on their first call.

        Returns where the compiled code is cached; raises RuntimeError if a kernel gives a wrong
        answer or leaves an example to the torch engine (numba's own errors pass through), and
        CompileWaitTimeoutError past `deadline` (time.monotonic) waiting for another process's
        compile that shows no progress.
        """
        probe = NumbaEngine()
        probe.fallback = NoFallback()
        checks = {"engine": probe.check_examples}
        warm_ups = {name: partial(warm, self) for name, warm in (halves or {}).items()}
        if examples:
            compile_once.once_per_host({**checks, **warm_ups}, deadline)
        else:
            compile_once.once_per_host(warm_ups, deadline, checks)
        where = compile_once.cache_location()
        return f"cached in {where.path}" if where.path else where.note

    def kernels_origin(self) -> str:
        """Whether this process's kernels came from numba's disk cache, and where it lives."""
        return compile_once.describe()

    def check_examples(self) -> None:
        """Run every kernel on its docstring example (bf16 and float32 rows); RuntimeError if wrong."""
        rows_X1 = _f32([[1.0], [2.0], [3.0]])
        for dtype in (torch.bfloat16, torch.float32):
            gathered_n1 = torch.empty(2, 1, dtype=dtype, device="cpu")
            self.copy_rows(rows_X1.to(dtype), _i64([2, 0]), gathered_n1, None)
            acc_N1 = torch.zeros(2, 1, dtype=torch.float32, device="cpu")
            self.accumulate_rows(
                acc_N1, rows_X1.to(dtype), _i64([1, 0, 1]), torch.ones(3, dtype=torch.float32, device="cpu")
            )
            y_NKH = rows_X1.to(dtype).view(1, 3, 1)
            summed_N1 = self.weighted_sum(
                y_NKH, _f32([[0.5, 2.0, 1.0]]), torch.ones(1, 3, dtype=torch.bool, device="cpu")
            )
            if gathered_n1.tolist() != [[3.0], [1.0]] or acc_N1.tolist() != [[2.0], [4.0]]:
                raise RuntimeError(f"numba kernels: wrong copy or accumulate for {dtype}")
            if summed_N1.tolist() != [[7.5]]:
                raise RuntimeError(f"numba kernels: wrong weighted_sum for {dtype}")
        local_nK = torch.empty(1, 3, dtype=torch.int64, device="cpu")
        weights_nK = torch.empty(1, 3, dtype=torch.float32, device="cpu")
        topk_XK, local_of_expert_E = _i64([[3, 0, -1]]), _i64([-1, -1, 0, 1])
        self.localize_rows(
            topk_XK,
            torch.ones(1, 3, dtype=torch.float32, device="cpu"),
            _i64([0]),
            local_of_expert_E,
            local_nK,
            weights_nK,
        )
        if local_nK.tolist() != [[1, -1, -1]] or weights_nK.tolist() != [[1.0, 0.0, 0.0]]:
            raise RuntimeError("numba kernels: wrong localize_rows")
        in_rank_NR, counts_R = self.route(_i64([[3, 0], [1, -1]]), np.array([0, 0, 1, 1]), 2)
        if in_rank_NR.tolist() != [[True, True], [True, False]] or counts_R.tolist() != [2, 1]:
            raise RuntimeError("numba kernels: wrong route")
        self._check_low_latency_examples()
        self._check_block_examples()

    def _check_low_latency_examples(self) -> None:
        """The low-latency plans on their docstring examples (experts 0-1 on rank 0, 2-3 on rank 1)."""
        rank_of_E, local_of_E = _i64([0, 0, 1, 1]), _i64([0, 1, 0, 1])
        pairs = self.ll_pairs(_i64([[3, 0], [1, -1]]), rank_of_E, local_of_E, 2)
        if [p.tolist() for p in pairs] != [[0, 1, 0], [1, 0, 0], [0, 1, 1], [[1, 1], [0, 1]]]:
            raise RuntimeError("numba kernels: wrong ll_pairs")
        owners = self.ll_owners(_i64([[3, -1]]), rank_of_E, local_of_E, 2)
        if [o.tolist() for o in owners] != [[[1, -1]], [[1, -1]], [[True, False]], [0, 1]]:
            raise RuntimeError("numba kernels: wrong ll_owners")
        returns = self.ll_returns(
            torch.tensor([2, 1], dtype=torch.int32, device="cpu"), _i64([[1, 0], [0, -1]]), 2
        )
        if [r.tolist() for r in returns] != [[0, 1, 0], [1, 0, 0], [2, 1]]:
            raise RuntimeError("numba kernels: wrong ll_returns")

    def _check_block_examples(self) -> None:
        """The several-source kernels on their docstring examples, for every row dtype a call reduces,
        so that a bad cached copy of one fails here and not inside a call."""
        a_b, c_d = _f32([[1.0], [2.0]]), _f32([[3.0], [4.0]])
        gathered_31 = torch.empty(3, 1, dtype=torch.float32, device="cpu")
        self.gather_blocks([a_b, c_d], [_i64([1]), _i64([0, 1])], gathered_31, [0, 1])
        if gathered_31.tolist() != [[2.0], [3.0], [4.0]]:
            raise RuntimeError("numba kernels: wrong gather_blocks")
        out_idx_21 = torch.empty(2, 1, dtype=torch.int64, device="cpu")
        out_w_21 = torch.empty(2, 1, dtype=torch.float32, device="cpu")
        topks = [_i64([[2]]), _i64([[0], [3]])]
        weights = [_f32([[0.5]]), _f32([[1.0], [2.0]])]
        rows = [_i64([0]), _i64([1])]
        self.localize_blocks(topks, weights, rows, _i64([-1, -1, 0, 1]), out_idx_21, out_w_21)
        if out_idx_21.tolist() != [[0], [1]] or out_w_21.tolist() != [[0.5], [2.0]]:
            raise RuntimeError("numba kernels: wrong localize_blocks")
        for row_dtype in ROW_DTYPES:
            for out_dtype in (torch.bfloat16, torch.float32):
                reduced_31 = torch.empty(3, 1, dtype=out_dtype, device="cpu")
                blocks = [a_b.to(row_dtype), c_d[:1].to(row_dtype)]
                self.reduce_blocks(blocks, [_i64([0, 2]), _i64([0])], reduced_31)
                if reduced_31.tolist() != [[4.0], [0.0], [2.0]]:
                    raise RuntimeError(f"numba kernels: wrong reduce_blocks for {row_dtype} into {out_dtype}")

    def copy_rows(
        self,
        src_XB: torch.Tensor,
        src_index_n: torch.Tensor | None,
        dst_YB: torch.Tensor,
        dst_index_n: torch.Tensor | None,
    ) -> None:
        n = next((i.numel() for i in (src_index_n, dst_index_n) if i is not None), src_XB.shape[0])
        try:
            src_XB, dst_YB = src_XB.view(torch.uint8), dst_YB.view(torch.uint8)  # rows as bytes
        except RuntimeError:  # a row that is not unit-stride
            return self.fallback.copy_rows(src_XB, src_index_n, dst_YB, dst_index_n)
        bad = kernels.UNSUPPORTED
        if src_XB.dim() == dst_YB.dim() == 2 and is_index(src_index_n) and is_index(dst_index_n):
            bad = launch(kernels.copy_rows, src_XB, src_index_n, dst_YB, dst_index_n, n) if n else kernels.OK
        if bad == kernels.UNSUPPORTED:
            return self.fallback.copy_rows(src_XB, src_index_n, dst_YB, dst_index_n)
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
        supported = (
            all(t.dtype in INDEX_DTYPES for t in (topk_XK, local_of_expert_E, out_idx_nK))
            and is_index(rows_n)
            and out_idx_nK.shape == (rows_n.numel(), topk_XK.shape[1])
            and (not with_weights or (weights_XK is not None and weights_XK.shape == topk_XK.shape))
            and (not with_weights or out_weights_nK.shape == out_idx_nK.shape)
            and (not with_weights or weights_XK.dtype == out_weights_nK.dtype == torch.float32)
        )
        bad = kernels.UNSUPPORTED
        if supported:
            weights = (weights_XK, out_weights_nK) if with_weights else (NO_WEIGHTS_nK, NO_WEIGHTS_nK)
            bad = launch(kernels.localize_rows, topk_XK, rows_n, local_of_expert_E, out_idx_nK, *weights)
        if bad == kernels.UNSUPPORTED:
            return self.fallback.localize_rows(
                topk_XK, weights_XK, rows_n, local_of_expert_E, out_idx_nK, out_weights_nK
            )
        check(bad, rows_n.numel(), "localize_rows: rows_n", "localize_rows: an expert id in topk_XK, row")

    def accumulate_rows(
        self,
        acc_NH: torch.Tensor,
        rows_nH: torch.Tensor,
        token_n: torch.Tensor,
        weight_n: torch.Tensor | None = None,
    ) -> None:
        n = token_n.numel()
        supported = (
            acc_NH.dtype == torch.float32
            and rows_nH.dtype in ROW_DTYPES
            and acc_NH.dim() == rows_nH.dim() == 2
            and rows_nH.shape == (n, acc_NH.shape[1])
            and (weight_n is None or (weight_n.dtype == torch.float32 and weight_n.shape == (n,)))
            and is_index(token_n)
        )
        weight = NO_WEIGHT_n if weight_n is None else weight_n
        bad = (
            launch(kernels.accumulate_rows, acc_NH, rows_nH, token_n, weight)
            if supported
            else kernels.UNSUPPORTED
        )
        if bad == kernels.UNSUPPORTED:
            return self.fallback.accumulate_rows(acc_NH, rows_nH, token_n, weight_n)
        check(bad, n, "accumulate_rows: token_n")

    def gather_blocks(
        self,
        sources: Sequence[torch.Tensor],
        indices: Sequence[torch.Tensor],
        out_MB: torch.Tensor,
        starts: Sequence[int],
    ) -> None:
        try:
            out_bytes = out_MB.view(torch.uint8)
        except RuntimeError:
            return self.fallback.gather_blocks(sources, indices, out_MB, starts)
        width = out_bytes.shape[1] if out_bytes.dim() == 2 else -1
        supported = len(sources) == len(indices) == len(starts) and all(
            src.dtype == out_MB.dtype and src.dim() == 2 and src.shape[1] == out_MB.shape[1]
            and (src.shape[1] <= 1 or src.stride(1) == 1) and is_index(index)
            for src, index in zip(sources, indices, strict=False)
        )  # fmt: skip
        if not supported or not sources or width < 0 or (out_bytes.shape[0] > 1 and out_bytes.stride(1) != 1):
            return self.fallback.gather_blocks(sources, indices, out_MB, starts)
        address_S = np.array([src.data_ptr() for src in sources], dtype=np.int64)
        stride_S = np.array([src.stride(0) * src.element_size() for src in sources], dtype=np.int64)
        rows_S = np.array([src.shape[0] for src in sources], dtype=np.int64)
        prefix_S1, index_M = _concatenated(indices)
        start_S = np.asarray(starts, dtype=np.int64)
        bad = launch(
            kernels.gather_blocks, address_S, stride_S, rows_S, index_M, prefix_S1, start_S, out_bytes
        )
        if bad >= 0:
            raise IndexError(f"gather_blocks: row index at position {bad} is out of range")

    def localize_blocks(
        self,
        topks: Sequence[torch.Tensor],
        weights: Sequence[torch.Tensor],
        indices: Sequence[torch.Tensor],
        local_of_expert_E: torch.Tensor,
        out_idx_MK: torch.Tensor,
        out_weights_MK: torch.Tensor,
    ) -> None:
        K = out_idx_MK.shape[1] if out_idx_MK.dim() == 2 else -1
        supported = (
            out_idx_MK.dtype == torch.int64 and out_weights_MK.dtype == torch.float32
            and out_idx_MK.is_contiguous() and out_weights_MK.is_contiguous()
            and out_weights_MK.shape == out_idx_MK.shape and local_of_expert_E.dtype == torch.int64
            and len(topks) == len(weights) == len(indices) and len(topks) > 0 and K > 0
            and all(
                t.dtype == torch.int64 and w.dtype == torch.float32 and t.dim() == w.dim() == 2
                and t.shape == w.shape and t.shape[1] == K and t.stride() == w.stride()
                and (K == 1 or t.stride(1) == 1) and is_index(i)
                for t, w, i in zip(topks, weights, indices, strict=False)
            )
        )  # fmt: skip
        if not supported:
            return self.fallback.localize_blocks(
                topks, weights, indices, local_of_expert_E, out_idx_MK, out_weights_MK
            )
        address_S = np.array([t.data_ptr() for t in topks], dtype=np.int64)
        weights_S = np.array([w.data_ptr() for w in weights], dtype=np.int64)
        stride_S = np.array([t.stride(0) for t in topks], dtype=np.int64)
        rows_S = np.array([t.shape[0] for t in topks], dtype=np.int64)
        prefix_S1, index_M = _concatenated(indices)
        bad = launch(
            kernels.localize_blocks, TOPK_LIKE, address_S, weights_S, stride_S, rows_S, index_M, prefix_S1,
            local_of_expert_E, out_idx_MK, out_weights_MK,
        )  # fmt: skip
        M = index_M.size
        if bad >= 0:  # its row's block: the last one starting at or before it
            block = int(np.searchsorted(prefix_S1, bad - M if bad >= M else bad, side="right")) - 1
            raise BlockIndexError(block, "expert" if bad >= M else "row")

    def reduce_blocks(
        self, blocks: Sequence[torch.Tensor], tokens: Sequence[torch.Tensor], out_NH: torch.Tensor
    ) -> None:
        dtype, H = out_NH.dtype, out_NH.shape[1]
        supported = (
            dtype in (torch.bfloat16, torch.float32)
            and out_NH.dim() == 2
            and out_NH.is_contiguous()
            and len(blocks) == len(tokens)
            and all(
                b.dtype in ROW_DTYPES and b.dtype == blocks[0].dtype and b.dim() == 2 and b.shape[1] == H
                and (b.shape[0] <= 1 or b.stride(1) == 1) and b.shape[0] == t.numel() and is_index(t)
                for b, t in zip(blocks, tokens, strict=False)
            )
        )  # fmt: skip
        if not supported or not blocks:
            return self.fallback.reduce_blocks(blocks, tokens, out_NH)
        address_S = np.array([b.data_ptr() for b in blocks], dtype=np.int64)
        stride_S = np.array([b.stride(0) * b.element_size() for b in blocks], dtype=np.int64)
        prefix_S1, token_M = _concatenated(tokens)
        like = np.empty(0, dtype=array(blocks[0][:0]).dtype)
        bad = launch(kernels.reduce_blocks, like, address_S, stride_S, token_M, prefix_S1, out_NH)
        if bad == kernels.UNSUPPORTED:
            return self.fallback.reduce_blocks(blocks, tokens, out_NH)
        if bad >= 0:
            raise IndexError(f"reduce_blocks: token at position {bad} is out of range or out of order")

    def route(
        self, topk_idx_NK: torch.Tensor, rank_of_expert_E: np.ndarray, num_ranks: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(is_token_in_rank bool [N, R], tokens per rank int64 [R]) of a contiguous int64 routing,
        after checking its values (ValueError in `ubep.validate`'s words): the values check of
        `validate.topk_idx`, `layout.token_in_rank` and its column sums in one compiled pass."""
        in_rank = np.empty((topk_idx_NK.shape[0], num_ranks), dtype=np.bool_)
        counts, found = np.empty(num_ranks, dtype=np.int64), np.zeros(1, dtype=np.int64)
        E = rank_of_expert_E.size
        args = (topk_idx_NK.numpy(), rank_of_expert_E, E, in_rank.view(np.uint8), counts, found)
        _raise_verdict(kernels.route_tokens(*args), topk_idx_NK, E, found)
        return tensors(in_rank, counts)

    def ll_pairs(
        self,
        topk_idx_NK: torch.Tensor,
        rank_of_expert_E: torch.Tensor,
        local_of_expert_E: torch.Tensor,
        R: int,
    ) -> tuple[torch.Tensor, ...]:
        """(token_P, k_P, local_P, counts_RL) of a contiguous int64 routing: its (token, expert) pairs
        ordered by (owner rank, local expert, token), after checking its values (ValueError in
        `ubep.validate`'s words); `ubep.protocols.ll.plans.dispatch_plan` in one compiled pass."""
        N, K = topk_idx_NK.shape
        E = rank_of_expert_E.numel()
        pairs_3P = np.empty((3, N * K), dtype=np.int64)  # token, k, local
        counts_RL, found = np.empty((R, E // R), dtype=np.int64), np.zeros(1, dtype=np.int64)
        P = kernels.ll_pairs(
            topk_idx_NK.numpy(), rank_of_expert_E.numpy(), local_of_expert_E.numpy(), found,
            pairs_3P[0], pairs_3P[1], pairs_3P[2], counts_RL,
        )  # fmt: skip
        if P < 0:
            _raise_verdict(P, topk_idx_NK, E, found)
        return tensors(pairs_3P[0, :P], pairs_3P[1, :P], pairs_3P[2, :P], counts_RL)

    def ll_owners(
        self,
        topk_idx_NK: torch.Tensor,
        rank_of_expert_E: torch.Tensor,
        local_of_expert_E: torch.Tensor,
        R: int,
    ) -> tuple[torch.Tensor, ...]:
        """(owner_NK, local_NK, valid_NK, expected_R) of a contiguous int64 routing: the rank and local
        id of each selected expert (-1 where none), whether one is, and the rows each rank returns,
        after checking its values as `ll_pairs` does."""
        N, K = topk_idx_NK.shape
        owner, local = np.empty((N, K), dtype=np.int64), np.empty((N, K), dtype=np.int64)
        expected, found = np.empty(R, dtype=np.int64), np.zeros(1, dtype=np.int64)
        args = (topk_idx_NK.numpy(), rank_of_expert_E.numpy(), local_of_expert_E.numpy(), found)
        verdict = kernels.ll_owners(*args, owner, local, expected)
        if verdict != kernels.OK:
            _raise_verdict(verdict, topk_idx_NK, rank_of_expert_E.numel(), found)
        return tensors(owner, local, owner >= 0, expected)

    def ll_returns(
        self, recv_count_L: torch.Tensor, src_rank_LM: torch.Tensor, R: int
    ) -> tuple[torch.Tensor, ...]:
        """(local_Q, row_Q, counts_R): the rows a low-latency dispatch received, ordered by (home rank,
        local expert, row), and the rows per home; ValueError where a row's source is not a rank."""
        L, M = src_rank_LM.shape
        local_Q, row_Q = np.empty(L * M, dtype=np.int64), np.empty(L * M, dtype=np.int64)
        counts_R, found = np.empty(R, dtype=np.int64), np.zeros(2, dtype=np.int64)
        Q = kernels.ll_returns(recv_count_L.numpy(), src_rank_LM.numpy(), found, local_Q, row_Q, counts_R)
        if Q == kernels.BAD_SOURCE:
            j, i = found.tolist()
            raise ValueError(
                f"handle: received row {i} of local expert {j} names source rank "
                f"{int(src_rank_LM[j, i])}, not one of the {R} ranks (the handle was changed)"
            )
        return tensors(local_Q[:Q], row_Q[:Q], counts_R)

    def weighted_sum(self, y_NKH: torch.Tensor, w_NK: torch.Tensor, valid_NK: torch.Tensor) -> torch.Tensor:
        supported = (
            y_NKH.dtype in ROW_DTYPES
            and y_NKH.dim() == 3
            and w_NK.dtype == torch.float32
            and valid_NK.dtype == torch.bool
            and w_NK.shape == valid_NK.shape == y_NKH.shape[:2]
        )
        out_NH = torch.empty(y_NKH.shape[0], y_NKH.shape[-1], dtype=torch.float32, device=y_NKH.device)
        bad = (
            launch(kernels.weighted_sum, y_NKH, w_NK, valid_NK, out_NH) if supported else kernels.UNSUPPORTED
        )
        if bad == kernels.UNSUPPORTED:
            return self.fallback.weighted_sum(y_NKH, w_NK, valid_NK)
        return out_NH

"""The triton engine: the kernel interface as Triton kernels (`ubep.engine.triton_kernels`).

    routing -> layout -> schedule -> protocol -> [engine: triton] -> transport

On CUDA tensors the kernels are compiled for the device; on CPU tensors they
run only under the Triton interpreter (`TRITON_INTERPRET=1` set before triton
is imported), which is for tests: the same source, slowly. Results equal the
torch engine's bit for bit (NaN payloads aside, see docs/device.md).

Beyond the `Engine` protocol it offers what a device protocol is made of:
gathers from (and scatters into) several peers through a pointer table, FP8
quantize/dequantize while moving, and the two data-as-flag variants: flag after
data (`put_rows_flag` / `wait_flags`) and epoch-stamped words (`pack_put` /
`unpack_wait`). Waits are bounded and return what did not land; the caller
turns that into its deadline error.

Legend: see `ubep.layout`; n rows moved by one call, X rows in a source, P peers.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from ubep.engine.base import PerBlock
from ubep.engine.torch_engine import as_words
from ubep.registry import TRITON

COPY_BLOCK = 1024  # words per program of a row copy
SUM_BLOCK = 512  # float32 columns per program of a reduction
FP8_GROUP = 8  # 128-channel blocks per program of an FP8 conversion
FLAG_DTYPE = torch.int64
TABLE_CACHE = 64  # pointer tables kept per engine (a Buffer uses a handful of regions)
EPOCH_LIMIT = 2**32  # a data-as-flag word holds the epoch in 32 bits
INTERPRETER_LOCK = threading.Lock()  # guards triton's interpreter, whose grid state is module-global


def triton_support() -> tuple[bool, str]:
    """(usable, why): compiled kernels where CUDA is available, or the interpreter on CPU for tests."""
    try:
        from ubep.engine import triton_kernels
    except ImportError as e:
        return False, f"triton is not importable ({e})"
    if _interpreted(triton_kernels.copy_rows_kernel):
        return True, "Triton interpreter on CPU tensors (TRITON_INTERPRET=1: for tests, slow)"
    if torch.cuda.is_available():
        return True, "Triton kernels compiled for the CUDA device"
    return False, (
        "no CUDA device, and the Triton interpreter is off: on CPU the triton engine is for tests and "
        "needs TRITON_INTERPRET=1 in the environment before triton is imported"
    )


def _interpreted(kernel) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """t as 2-D rows [X, ...] -> [X, B] without a copy; ValueError if the rows are not contiguous inside."""
    if t.dim() == 2:
        rows = t
    else:
        try:
            rows = t.view(t.shape[0], -1)
        except RuntimeError as e:
            raise ValueError(f"{name}: each row must be contiguous, got strides {t.stride()}") from e
    if rows.shape[1] > 1 and rows.stride(1) != 1:
        raise ValueError(f"{name}: each row must be contiguous, got strides {t.stride()}")
    return rows


def _index(index_n: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(index or a placeholder pointer, whether indexed)."""
    return (like, False) if index_n is None else (index_n, True)


class TritonEngine(PerBlock):
    """Kernels as Triton programs; see `ubep.engine.base.Engine` for the contract of each."""

    name = TRITON.name

    def __init__(self) -> None:
        ok, reason = triton_support()
        if not ok:
            raise ValueError(f"engine='triton' is not available: {reason}")
        from ubep.engine import triton_kernels

        self.reason = reason
        self._k = triton_kernels
        self._interpreted = _interpreted(triton_kernels.copy_rows_kernel)
        self._tables: dict[tuple[int, ...], torch.Tensor] = {}  # pointer tables by their addresses

    def _run(self, kernel, grid: tuple[int, ...], *args, **consts) -> None:
        """Launch with FMA contraction off, so every product and sum rounds as the torch engine's do.

        The interpreter keeps the running grid in module state, so interpreted
        launches from several threads (virtual ranks) take turns.
        """
        if self._interpreted:
            with INTERPRETER_LOCK:
                kernel[grid](*args, **consts, enable_fp_fusion=False)
        else:
            kernel[grid](*args, **consts, enable_fp_fusion=False)

    def launch(self, kernel, grid: tuple[int, ...], *args, **consts) -> None:
        """Launch a kernel of another module (a protocol's call half) as this engine launches its own."""
        self._run(kernel, grid, *args, **consts)

    def _device(self, *tensors: torch.Tensor) -> None:
        """The interpreter reads host memory, compiled kernels device memory: say so instead of crashing."""
        for t in tensors:
            if t.is_cuda == self._interpreted:
                where = "CPU (Triton interpreter)" if self._interpreted else "CUDA"
                raise ValueError(f"the triton engine here runs on {where} tensors, got one on {t.device}")

    # --- rows as words ---------------------------------------------------------------------------------

    def copy_rows(
        self,
        src_XB: torch.Tensor,
        src_index_n: torch.Tensor | None,
        dst_YB: torch.Tensor,
        dst_index_n: torch.Tensor | None,
    ) -> None:
        src_w, dst_w = as_words(_rows(src_XB, "src"), _rows(dst_YB, "dst"))
        self._move([src_w], None, src_index_n, [dst_w], None, dst_index_n)

    def gather_rows(
        self,
        srcs: Sequence[torch.Tensor],
        peer_n: torch.Tensor,
        src_index_n: torch.Tensor | None,
        dst_YB: torch.Tensor,
        dst_index_n: torch.Tensor | None,
    ) -> None:
        """dst[dst_index[i]] = srcs[peer[i]][src_index[i]]: rows from several peers in one launch.

        `srcs` are the same region in every peer's memory (equal shapes and
        strides); the kernel reaches them through a table of their addresses.
        """
        *src_w, dst_w = as_words(*(_rows(s, f"srcs[{p}]") for p, s in enumerate(srcs)), _rows(dst_YB, "dst"))
        self._move(src_w, peer_n, src_index_n, [dst_w], None, dst_index_n)

    def scatter_rows(
        self,
        src_XB: torch.Tensor,
        src_index_n: torch.Tensor | None,
        dsts: Sequence[torch.Tensor],
        peer_n: torch.Tensor,
        dst_index_n: torch.Tensor | None,
    ) -> None:
        """dsts[peer[i]][dst_index[i]] = src[src_index[i]]: puts into several peers in one launch."""
        src_w, *dst_w = as_words(_rows(src_XB, "src"), *(_rows(d, f"dsts[{p}]") for p, d in enumerate(dsts)))
        self._move([src_w], None, src_index_n, dst_w, peer_n, dst_index_n)

    def _move(self, srcs, src_peer_n, src_index_n, dsts, dst_peer_n, dst_index_n, flag=None) -> None:
        given = [t.shape[0] for t in (src_peer_n, dst_peer_n, src_index_n, dst_index_n) if t is not None]
        n = given[0] if given else srcs[0].shape[0]
        if n == 0:
            return
        self._device(srcs[0], dsts[0])
        src_table, dst_table = src_peer_n is not None, dst_peer_n is not None
        src, src_stride = self._place(srcs, "srcs", src_table)
        dst, dst_stride = self._place(dsts, "dsts", dst_table)
        width = srcs[0].shape[1]
        if dsts[0].shape[1] != width:
            raise ValueError(f"rows differ in width: {srcs[0].shape[1]} and {dsts[0].shape[1]} words")
        src_index, src_indexed = _index(src_index_n, srcs[0])
        dst_index, dst_indexed = _index(dst_index_n, srcs[0])
        src_peers = src_peer_n if src_peer_n is not None else srcs[0]
        dst_peers = dst_peer_n if dst_peer_n is not None else srcs[0]
        grid = (n, _cdiv(width, COPY_BLOCK))
        consts = dict(
            WORD=_tl_dtype(srcs[0].dtype),
            SRC_PEERS=src_table,
            DST_PEERS=dst_table,
            SRC_INDEXED=src_indexed,
            DST_INDEXED=dst_indexed,
            BLOCK=min(COPY_BLOCK, _pow2(width)),
        )
        rows = (src, src_peers, src_index, src_stride, dst, dst_peers, dst_index, dst_stride, width)
        if flag is None:
            self._run(self._k.copy_rows_kernel, grid, *rows, **consts)
        else:
            flag_1, arrivals_1, epoch = flag
            flagged = (arrivals_1, flag_1, epoch, grid[0] * grid[1])
            self._run(self._k.put_rows_flag_kernel, grid, *rows, *flagged, **consts)

    def _place(self, tensors: Sequence[torch.Tensor], name: str, table: bool) -> tuple[torch.Tensor, int]:
        """(the one tensor, or with `table` a table of the tensors' addresses; their row stride)."""
        strides = {t.stride(0) for t in tensors}
        if len(strides) != 1 or len({t.shape[1] for t in tensors}) != 1:
            raise ValueError(f"{name}: every peer's rows must have one width and row stride")
        if not table:
            return tensors[0], strides.pop()
        addresses = tuple(t.data_ptr() for t in tensors)
        table_P = self._tables.get(addresses)
        if table_P is None:  # a table holds only addresses, so a cached one is never stale
            if len(self._tables) >= TABLE_CACHE:
                self._tables.clear()
            table_P = torch.tensor(addresses, dtype=torch.int64, device=tensors[0].device)
            self._tables[addresses] = table_P
        return table_P, strides.pop()

    # --- the two data-as-flag variants -------------------------------------------------------------------

    def put_rows_flag(
        self,
        src_XB: torch.Tensor,
        src_index_n: torch.Tensor | None,
        dst_YB: torch.Tensor,
        dst_index_n: torch.Tensor | None,
        flag_1: torch.Tensor,
        arrivals_1: torch.Tensor,
        epoch: int,
    ) -> None:
        """Flag after data: copy rows into dst (a peer's region), then set flag = epoch with release.

        `arrivals_1` is a zeroed int64 word of the writer's own, reused across
        calls (the last program resets it). Readers call `wait_flags`.
        """
        _check_flag(flag_1, "flag_1")
        _check_flag(arrivals_1, "arrivals_1")
        src_w, dst_w = as_words(_rows(src_XB, "src"), _rows(dst_YB, "dst"))
        n = src_w.shape[0] if src_index_n is None else src_index_n.shape[0]
        if n == 0:
            self.write_flags(flag_1, epoch)
            return
        self._move([src_w], None, src_index_n, [dst_w], None, dst_index_n, flag=(flag_1, arrivals_1, epoch))

    def write_flags(self, flags_n: torch.Tensor, epoch: int) -> None:
        """flags[i] = epoch for every i, each with a system-scope release."""
        _check_flag(flags_n, "flags_n")
        self._device(flags_n)
        self._run(self._k.flag_write_kernel, (flags_n.numel(),), flags_n, epoch)

    def wait_flags(self, flags_n: torch.Tensor, epoch: int, max_spins: int) -> torch.Tensor:
        """bool [n]: whether flags[i] reached `epoch` within `max_spins` acquire reads (False: not landed)."""
        _check_flag(flags_n, "flags_n")
        if max_spins < 0:
            raise ValueError(f"max_spins must be >= 0, got {max_spins}")
        self._device(flags_n)
        landed_n = torch.zeros(flags_n.numel(), dtype=torch.int32, device=flags_n.device)
        self._run(self._k.flag_wait_kernel, (flags_n.numel(),), flags_n, epoch, landed_n, max_spins)
        return landed_n.bool()

    def pack_put(
        self,
        src_XB: torch.Tensor,
        src_index_n: torch.Tensor | None,
        dst_YW: torch.Tensor,
        dst_index_n: torch.Tensor | None,
        epoch: int,
    ) -> None:
        """Data as flag: each 4 payload bytes of a row travel as one int64 word (epoch << 32) | payload.

        `dst_YW` is int64 [Y, B // 4] (a peer's region; twice the payload's bytes).
        """
        src = _rows(src_XB, "src")
        width = _payload_words(src, dst_YW, epoch)
        n = src.shape[0] if src_index_n is None else src_index_n.shape[0]
        if n == 0:
            return
        self._device(src, dst_YW)
        src_index, src_indexed = _index(src_index_n, dst_YW)
        dst_index, dst_indexed = _index(dst_index_n, dst_YW)
        payload = src.view(torch.int32)
        self._run(
            self._k.pack_put_kernel,
            (n, _cdiv(width, COPY_BLOCK)),
            payload,
            src_index,
            payload.stride(0),
            dst_YW,
            dst_index,
            dst_YW.stride(0),
            epoch,
            width,
            SRC_INDEXED=src_indexed,
            DST_INDEXED=dst_indexed,
            BLOCK=min(COPY_BLOCK, _pow2(width)),
        )

    def unpack_wait(
        self,
        src_XW: torch.Tensor,
        src_index_n: torch.Tensor | None,
        dst_YB: torch.Tensor,
        dst_index_n: torch.Tensor | None,
        epoch: int,
        max_spins: int,
    ) -> torch.Tensor:
        """Data as flag, receiver: epoch-stamped words -> payload rows; int32 [1]: the words not landed.

        Each row block is consumed as soon as its words carry `epoch`; a count of
        0 means every row arrived, otherwise rows are incomplete after `max_spins`
        polls. The count is a device tensor: reading it waits for the kernel.
        """
        dst = _rows(dst_YB, "dst")
        width = _payload_words(dst, src_XW, epoch)
        n = src_XW.shape[0] if src_index_n is None else src_index_n.shape[0]
        if n == 0:
            return torch.zeros(1, dtype=torch.int32, device=dst.device)
        self._device(src_XW, dst)
        missing_1 = torch.zeros(1, dtype=torch.int32, device=dst.device)
        src_index, src_indexed = _index(src_index_n, src_XW)
        dst_index, dst_indexed = _index(dst_index_n, src_XW)
        payload = dst.view(torch.int32)
        self._run(
            self._k.unpack_wait_kernel,
            (n, _cdiv(width, COPY_BLOCK)),
            src_XW,
            src_index,
            src_XW.stride(0),
            payload,
            dst_index,
            payload.stride(0),
            epoch,
            width,
            max_spins,
            missing_1,
            SRC_INDEXED=src_indexed,
            DST_INDEXED=dst_indexed,
            BLOCK=min(COPY_BLOCK, _pow2(width)),
        )
        return missing_1

    # --- reductions --------------------------------------------------------------------------------------

    def accumulate_rows(
        self,
        acc_NH: torch.Tensor,
        rows_nH: torch.Tensor,
        token_n: torch.Tensor,
        weight_n: torch.Tensor | None = None,
    ) -> None:
        if token_n.numel() == 0:
            return
        if acc_NH.dtype != torch.float32 or acc_NH.stride(1) != 1 or rows_nH.stride(1) != 1:
            raise ValueError("accumulate_rows: acc must be float32 and rows contiguous inside")
        self._device(acc_NH, rows_nH, token_n)
        N, H = acc_NH.shape
        counts_N = torch.bincount(token_n, minlength=N)
        if counts_N.numel() > N or int(token_n.min()) < 0:
            raise ValueError(f"accumulate_rows: token ids must lie in [0, {N})")
        order_n = torch.argsort(token_n, stable=True)
        starts_N1 = torch.zeros(N + 1, dtype=torch.int64, device=acc_NH.device)
        torch.cumsum(counts_N, 0, out=starts_N1[1:])
        weights = weight_n.to(torch.float32) if weight_n is not None else order_n
        self._run(
            self._k.accumulate_rows_kernel,
            (N, _cdiv(H, SUM_BLOCK)),
            acc_NH,
            acc_NH.stride(0),
            rows_nH,
            rows_nH.stride(0),
            order_n,
            starts_N1,
            weights,
            H,
            WEIGHTED=weight_n is not None,
            BLOCK=min(SUM_BLOCK, _pow2(H)),
        )

    def weighted_sum(self, y_NKH: torch.Tensor, w_NK: torch.Tensor, valid_NK: torch.Tensor) -> torch.Tensor:
        N, K, H = y_NKH.shape
        out_NH = torch.empty(N, H, dtype=torch.float32, device=y_NKH.device)
        if N == 0 or H == 0:
            return out_NH.zero_()
        if y_NKH.stride(2) != 1:
            raise ValueError("weighted_sum: y rows must be contiguous inside")
        self._device(y_NKH, w_NK, valid_NK)
        w = w_NK.to(torch.float32).contiguous()
        valid = valid_NK.contiguous().view(torch.uint8)
        self._run(
            self._k.weighted_sum_kernel,
            (N, _cdiv(H, SUM_BLOCK)),
            y_NKH,
            y_NKH.stride(0),
            y_NKH.stride(1),
            w,
            valid,
            K,
            out_NH,
            H,
            BLOCK=min(SUM_BLOCK, _pow2(H)),
        )
        return out_NH

    # --- routing -----------------------------------------------------------------------------------------

    def localize_rows(
        self,
        topk_XK: torch.Tensor,
        weights_XK: torch.Tensor | None,
        rows_n: torch.Tensor,
        local_of_expert_E: torch.Tensor,
        out_idx_nK: torch.Tensor,
        out_weights_nK: torch.Tensor | None,
    ) -> None:
        count = out_idx_nK.numel()
        if count == 0:
            return
        if not out_idx_nK.is_contiguous() or (
            out_weights_nK is not None and not out_weights_nK.is_contiguous()
        ):
            raise ValueError("localize_rows: outputs must be contiguous")
        self._device(topk_XK, rows_n, out_idx_nK)
        weighted = out_weights_nK is not None
        weights = weights_XK if weighted else topk_XK
        block = 256
        self._run(
            self._k.localize_rows_kernel,
            (_cdiv(count, block),),
            topk_XK,
            topk_XK.stride(0),
            weights,
            weights.stride(0),
            rows_n,
            local_of_expert_E.contiguous(),
            out_idx_nK,
            out_weights_nK if weighted else out_idx_nK,
            count,
            topk_XK.shape[1],
            WEIGHTED=weighted,
            BLOCK=block,
        )

    # --- FP8 while moving --------------------------------------------------------------------------------

    def quantize_rows(
        self,
        x_XH: torch.Tensor,
        src_index_n: torch.Tensor | None,
        values_YH: torch.Tensor,
        scales_YB: torch.Tensor,
        dst_index_n: torch.Tensor | None,
    ) -> None:
        """values/scales row dst_index[i] = `ubep.fp8.quantize` of x row src_index[i] (wire views work)."""
        n = x_XH.shape[0] if src_index_n is None else src_index_n.shape[0]
        nb = _fp8_blocks(x_XH, values_YH, scales_YB)
        if n == 0:
            return
        self._device(x_XH, values_YH, scales_YB)
        src_index, src_indexed = _index(src_index_n, scales_YB)
        dst_index, dst_indexed = _index(dst_index_n, scales_YB)
        values = values_YH.view(torch.uint8)
        self._run(
            self._k.quantize_rows_kernel,
            (n, _cdiv(nb, FP8_GROUP)),
            x_XH,
            x_XH.stride(0),
            src_index,
            values,
            values.stride(0),
            scales_YB,
            scales_YB.stride(0),
            dst_index,
            nb,
            SRC_INDEXED=src_indexed,
            DST_INDEXED=dst_indexed,
            BB=FP8_GROUP,
        )

    def dequantize_rows(
        self,
        values_XH: torch.Tensor,
        scales_XB: torch.Tensor,
        src_index_n: torch.Tensor | None,
        out_YH: torch.Tensor,
        dst_index_n: torch.Tensor | None,
    ) -> None:
        """out row dst_index[i] = `ubep.fp8.dequantize` of row src_index[i], in out's dtype (fp32 or bf16)."""
        if out_YH.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dequantize_rows: out must be float32 or bfloat16, got {out_YH.dtype}")
        n = values_XH.shape[0] if src_index_n is None else src_index_n.shape[0]
        nb = _fp8_blocks(out_YH, values_XH, scales_XB)
        if n == 0:
            return
        self._device(values_XH, scales_XB, out_YH)
        src_index, src_indexed = _index(src_index_n, scales_XB)
        dst_index, dst_indexed = _index(dst_index_n, scales_XB)
        values = values_XH.view(torch.uint8)
        bf16 = out_YH.dtype == torch.bfloat16
        out = out_YH.view(torch.int16) if bf16 else out_YH
        self._run(
            self._k.dequantize_rows_kernel,
            (n, _cdiv(nb, FP8_GROUP)),
            values,
            values.stride(0),
            scales_XB,
            scales_XB.stride(0),
            src_index,
            out,
            out.stride(0),
            dst_index,
            nb,
            OUT_BF16=bf16,
            SRC_INDEXED=src_indexed,
            DST_INDEXED=dst_indexed,
            BB=FP8_GROUP,
        )


def _check_flag(flag: torch.Tensor, name: str) -> None:
    if flag.dtype != FLAG_DTYPE or not flag.is_contiguous():
        raise ValueError(f"{name} must be contiguous int64 words, got {flag.dtype}")


def _payload_words(payload_XB: torch.Tensor, words_XW: torch.Tensor, epoch: int) -> int:
    """Words per row of a data-as-flag message (4 payload bytes each); ValueError on a mismatch."""
    if not 0 < epoch < EPOCH_LIMIT:
        raise ValueError(f"epoch must lie in [1, 2**32) for data-as-flag words, got {epoch}")
    row_bytes = payload_XB.shape[1] * payload_XB.element_size()
    if row_bytes % 4 or words_XW.dtype != torch.int64 or words_XW.shape[1] * 4 != row_bytes:
        raise ValueError(
            f"data-as-flag rows: payload rows of {row_bytes} bytes need int64 words [X, {row_bytes // 4}], "
            f"got {words_XW.dtype} {tuple(words_XW.shape)}"
        )
    if words_XW.stride(1) != 1:
        raise ValueError("data-as-flag words must be contiguous inside a row")
    return row_bytes // 4


def _fp8_blocks(x_XH: torch.Tensor, values_XH: torch.Tensor, scales_XB: torch.Tensor) -> int:
    """128-channel blocks per row; ValueError unless the three shapes agree and rows are contiguous inside."""
    H = x_XH.shape[1]
    if (
        H % 128
        or values_XH.shape[1] != H
        or scales_XB.shape[1] * 128 != H
        or scales_XB.dtype != torch.float32
    ):
        raise ValueError(
            f"FP8 rows: x [.., {H}] needs values [.., {H}] (H % 128 == 0) and float32 scales "
            f"[.., {H // 128}], "
            f"got {tuple(values_XH.shape)} and {scales_XB.dtype} {tuple(scales_XB.shape)}"
        )
    if any(t.stride(1) != 1 for t in (x_XH, values_XH, scales_XB)):
        raise ValueError("FP8 rows must be contiguous inside a row")
    return H // 128


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _tl_dtype(dtype: torch.dtype):
    import triton.language as tl

    return {torch.int64: tl.int64, torch.int32: tl.int32, torch.int16: tl.int16, torch.uint8: tl.uint8}[dtype]

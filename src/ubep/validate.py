"""Input checks at the public boundary, run before any byte is sent.

Each raises TypeError (wrong kind of object or dtype) or ValueError (wrong
shape or value) naming the argument and the rule. Legend: see `ubep.layout`.

Autograd: dispatch and combine are not differentiable (as in DeepEP), yet in
training the activations passed in require grad. The one rule, for every tensor
argument on every transport and protocol: a tensor that requires grad is
accepted and read as data (`detach()`, no copy); nothing returned requires grad
or records a graph. A model that needs gradients through the exchange wraps the
calls in a `torch.autograd.Function` (backward of dispatch is a combine, and of
combine a dispatch), which is how DeepEP is used in training.
"""

from __future__ import annotations

import math
import os

import torch

from ubep import fp8

PAYLOAD_DTYPES = (torch.bfloat16, torch.float32)
# A Buffer's tables with one entry per expert: owner rank and local index (int64 each), masked flag.
BYTES_PER_EXPERT = 8 + 8 + 1
# The longest deadline a wait may have: far past any peer's legitimate delay, and well inside what
# the clocks and backends it reaches can hold (datetime.timedelta, gloo's milliseconds, threading).
MAX_TIMEOUT_S = 7 * 24 * 3600


CPU = torch.device("cpu")


def tensor(
    name: str, value, dtype: torch.dtype | tuple[torch.dtype, ...], ndim: int, device: torch.device = CPU
) -> torch.Tensor:
    """A tensor of the given dtype(s) and rank on `device` (the Buffer's: the CPU, or its GPU on the
    CUDA heap), detached from autograd (see the module doc)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    allowed = dtype if isinstance(dtype, tuple) else (dtype,)
    if value.dtype not in allowed:
        names = " or ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"{name} must be {names}, got {str(value.dtype).removeprefix('torch.')}")
    if value.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(value.shape)}")
    got = value.device
    if got != device and not (got.type == device.type == "cuda" and None in (got.index, device.index)):
        raise ValueError(f"{name} is on {value.device}; this Buffer's tensors live on {device}")
    return value.detach() if value.requires_grad else value  # the caller's own object where possible


def payload(
    name: str, x, hidden: int, capacity: int, rows: int | None = None, device: torch.device = CPU
) -> torch.Tensor:
    """x [N, H]: bf16 or fp32, H == hidden, N <= capacity (and N == rows when given)."""
    x = tensor(name, x, PAYLOAD_DTYPES, 2, device)
    n, h = x.shape
    if h != hidden:
        raise ValueError(f"{name} has hidden size {h}, the Buffer was built for {hidden}")
    if rows is not None and n != rows:
        raise ValueError(f"{name} has {n} rows, expected {rows}")
    if n > capacity:
        raise ValueError(f"{name} has {n} tokens, more than max_tokens_per_rank={capacity}")
    return row_major(x)


def topk_idx(
    value, num_tokens: int, num_experts: int, max_topk: int, values: bool = True, device: torch.device = CPU
) -> torch.Tensor:
    """int64 [N, K] in [-1, E), K <= max_topk, no expert twice in a row (`values=False`: the caller
    checks the values itself, in one pass with the layout: `NumbaEngine.route`). int32 ids (vLLM's
    `topk_ids`) are widened here, once; every later step reads the int64 copy returned."""
    idx = tensor("topk_idx", value, (torch.int64, torch.int32), 2, device)
    if idx.dtype == torch.int32:
        idx = idx.to(torch.int64)
    n, k = idx.shape
    if n != num_tokens:
        raise ValueError(f"topk_idx has {n} rows, x has {num_tokens} tokens")
    if not 0 < k <= max_topk:
        raise ValueError(f"topk_idx has top-k {k}; it must lie in [1, max_topk={max_topk}]")
    if idx.numel() and values:
        lo, hi = int(idx.min()), int(idx.max())
        if lo < -1 or hi >= num_experts:
            raise bad_expert(num_experts, lo if lo < -1 else hi)
        ordered = idx.sort(dim=1).values
        repeated = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
        if repeated.any():
            raise repeated_expert(idx, int(torch.nonzero(repeated.any(dim=1))[0]))
    return idx.contiguous()


def bad_expert(num_experts: int, found: int) -> ValueError:
    return ValueError(f"topk_idx values must lie in [-1, {num_experts}); found {found}")


def repeated_expert(topk_idx_NK: torch.Tensor, row: int) -> ValueError:
    return ValueError(f"topk_idx row {row} lists the same expert twice: {topk_idx_NK[row].tolist()}")


def repeated_in_row(row: int, expert: int) -> ValueError:
    """`repeated_expert` as a device half reports it: the row and the expert, not the row's values."""
    return ValueError(f"topk_idx row {row} lists the same expert twice ({expert})")


def topk_weights(
    value, shape: tuple[int, int], name: str = "topk_weights", device: torch.device = CPU
) -> torch.Tensor:
    """float32 with the given [rows, K] shape."""
    w = tensor(name, value, torch.float32, 2, device)
    if tuple(w.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(w.shape)}, expected {tuple(shape)}")
    return w.contiguous()


def combine_weights(value, rows: int, max_topk: int, device: torch.device = CPU) -> torch.Tensor:
    """float32 [M, K] with K <= max_topk: combine sends each row's weights with it, into buffers and
    messages the Buffer sized for max_topk, so a wider one is refused here, before any byte is sent."""
    w = tensor("topk_weights", value, torch.float32, 2, device)
    if w.shape[0] != rows:
        raise ValueError(f"topk_weights has shape {tuple(w.shape)}, expected {(rows, w.shape[1])}")
    if w.shape[1] > max_topk:
        raise ValueError(
            f"topk_weights has {w.shape[1]} columns (top-k); it must be at most max_topk={max_topk}, "
            "the Buffer's sizing"
        )
    return w.contiguous()


def layout_args(
    num_tokens_per_rank, is_token_in_rank, computed_is_token_in_rank: torch.Tensor, device: torch.device = CPU
) -> None:
    """Caller-supplied layout must be what topk_idx implies (ubep derives routing from it)."""
    R = computed_is_token_in_rank.shape[1]
    if is_token_in_rank is not None:
        given = tensor("is_token_in_rank", is_token_in_rank, torch.bool, 2, device)
        if not torch.equal(given, computed_is_token_in_rank):
            raise ValueError("is_token_in_rank does not match topk_idx (pass both from get_dispatch_layout)")
    if num_tokens_per_rank is not None:
        given = tensor("num_tokens_per_rank", num_tokens_per_rank, (torch.int32, torch.int64), 1, device)
        if given.numel() != R or not torch.equal(given.long(), computed_is_token_in_rank.sum(0)):
            raise ValueError("num_tokens_per_rank does not match topk_idx")


def layout_shapes(num_tokens_per_rank, is_token_in_rank, num_tokens: int, num_ranks: int, device) -> None:
    """Caller-supplied layout of the right kind, its values unread: where the device derives the layout
    from topk_idx itself (`Buffer` on the Triton halves), comparing them would read back on the host."""
    if is_token_in_rank is not None:
        given = tensor("is_token_in_rank", is_token_in_rank, torch.bool, 2, device)
        if tuple(given.shape) != (num_tokens, num_ranks):
            raise ValueError(
                f"is_token_in_rank has shape {tuple(given.shape)}, expected {(num_tokens, num_ranks)}"
            )
    if num_tokens_per_rank is not None:
        given = tensor("num_tokens_per_rank", num_tokens_per_rank, (torch.int32, torch.int64), 1, device)
        if given.numel() != num_ranks:
            raise ValueError(f"num_tokens_per_rank has {given.numel()} entries, expected {num_ranks}")


def positive(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def seconds(name: str, value) -> float:
    """A deadline in seconds: a real number in (0, MAX_TIMEOUT_S]. "No deadline" (inf) is refused:
    every wait keeps one, and an unbounded one would overflow the timers it is handed to."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    if not (0 < value <= MAX_TIMEOUT_S and math.isfinite(value)):
        raise ValueError(f"{name} must be > 0 and at most {MAX_TIMEOUT_S} s (a week), got {value}")
    return float(value)


def expert_tables(num_experts: int) -> None:
    """Refuse a num_experts whose per-expert tables alone exceed this host's memory, before torch
    tries to allocate them (num_experts=2**40 would ask for 17 TiB)."""
    need, have = BYTES_PER_EXPERT * num_experts, host_memory_bytes()
    if need > have:
        raise ValueError(
            f"num_experts={num_experts} is too large: the per-expert tables alone take "
            f"{need / 2**30:,.0f} GiB ({BYTES_PER_EXPERT} bytes an expert), more than this host's "
            f"{have / 2**30:,.0f} GiB of memory"
        )


def host_memory_bytes() -> int:
    """This host's physical memory, in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def fp8_pair(
    name: str, value, hidden: int, capacity: int, rows: int | None = None, device: torch.device = CPU
):
    """(values float8_e4m3fn [N, H], scales float32 [N, H // 128]): the FP8 form of x."""
    values = tensor(f"{name}[0]", value[0], fp8.VALUE_DTYPE, 2, device)
    scales = tensor(f"{name}[1]", value[1], fp8.SCALE_DTYPE, 2, device)
    n, h = values.shape
    if h != hidden:
        raise ValueError(f"{name}[0] has hidden size {h}, the Buffer was built for {hidden}")
    if h % fp8.BLOCK:
        raise ValueError(
            f"{name}[0] has hidden size {h}: FP8 needs a multiple of {fp8.BLOCK} (one scale per "
            f"{fp8.BLOCK} channels)"
        )
    if tuple(scales.shape) != (n, h // fp8.BLOCK):
        raise ValueError(
            f"{name}[1] (scales) must have shape [N, H // {fp8.BLOCK}] = {(n, h // fp8.BLOCK)}, "
            f"got {tuple(scales.shape)}"
        )
    if rows is not None and n != rows:
        raise ValueError(f"{name} has {n} rows, expected {rows}")
    if n > capacity:
        raise ValueError(f"{name} has {n} tokens, more than max_tokens_per_rank={capacity}")
    return row_major(values), row_major(scales)


def row_major(t: torch.Tensor) -> torch.Tensor:
    """t with row-major strides (a copy only where needed). `contiguous()` leaves any stride on a
    dimension of size 0 or 1, and the engines view rows as bytes, which needs stride 1 in the last
    one: fp8.quantize's scales of 0 tokens at hidden 128 are [0, 1] with strides (1, 0)."""
    if t.dim() == 0 or (t.is_contiguous() and t.stride(-1) == 1):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def low_latency_x(
    x, hidden: int, max_tokens: int, capacity: int, use_fp8: bool, device: torch.device = CPU
) -> torch.Tensor:
    """x [N, H] for low-latency dispatch: N <= T <= the Buffer's max_tokens_per_rank."""
    positive("num_max_dispatch_tokens_per_rank", max_tokens)
    if max_tokens > capacity:
        raise ValueError(
            f"num_max_dispatch_tokens_per_rank ({max_tokens}) exceeds the Buffer's "
            f"max_tokens_per_rank ({capacity})"
        )
    if isinstance(x, tuple | list):
        raise TypeError("low_latency_dispatch takes x as a tensor; pass use_fp8=True to send FP8")
    x = tensor("x", x, PAYLOAD_DTYPES, 2, device)
    if x.shape[0] > max_tokens:
        raise ValueError(
            f"x has {x.shape[0]} tokens, more than num_max_dispatch_tokens_per_rank={max_tokens}"
        )
    if use_fp8 and hidden % 128:
        raise ValueError(f"use_fp8 needs a hidden size that is a multiple of 128, got {hidden}")
    return payload("x", x, hidden, max_tokens, device=device)


def expert_output(x, shape: tuple[int, int, int], device: torch.device = CPU) -> torch.Tensor:
    """The expert outputs for low-latency combine: bf16 or fp32 [L, R * T, H]."""
    x = tensor("x", x, PAYLOAD_DTYPES, 3, device)
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"x must have shape [L, R * T, H] = {tuple(shape)}, got {tuple(x.shape)}")
    return x.contiguous()

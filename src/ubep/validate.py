"""Input checks at the public boundary, run before any byte is sent.

Each raises TypeError (wrong kind of object or dtype) or ValueError (wrong
shape or value) naming the argument and the rule. Legend: see `ubep.layout`.
"""

from __future__ import annotations

import torch

PAYLOAD_DTYPES = (torch.bfloat16, torch.float32)


def tensor(name: str, value, dtype: torch.dtype | tuple[torch.dtype, ...], ndim: int) -> torch.Tensor:
    """A CPU tensor of the given dtype(s) and rank."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    allowed = dtype if isinstance(dtype, tuple) else (dtype,)
    if value.dtype not in allowed:
        names = " or ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"{name} must be {names}, got {str(value.dtype).removeprefix('torch.')}")
    if value.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(value.shape)}")
    if value.device.type != "cpu":
        raise ValueError(f"{name} is on {value.device}; this Buffer's transports take CPU tensors")
    return value


def payload(name: str, x, hidden: int, capacity: int, rows: int | None = None) -> torch.Tensor:
    """x [N, H]: bf16 or fp32, H == hidden, N <= capacity (and N == rows when given)."""
    x = tensor(name, x, PAYLOAD_DTYPES, 2)
    n, h = x.shape
    if h != hidden:
        raise ValueError(f"{name} has hidden size {h}, the Buffer was built for {hidden}")
    if rows is not None and n != rows:
        raise ValueError(f"{name} has {n} rows, expected {rows}")
    if n > capacity:
        raise ValueError(f"{name} has {n} tokens, more than max_tokens_per_rank={capacity}")
    return x.contiguous()


def topk_idx(value, num_tokens: int, num_experts: int, max_topk: int) -> torch.Tensor:
    """int64 [N, K] in [-1, E), K <= max_topk, no expert twice in a row."""
    idx = tensor("topk_idx", value, torch.int64, 2)
    n, k = idx.shape
    if n != num_tokens:
        raise ValueError(f"topk_idx has {n} rows, x has {num_tokens} tokens")
    if not 0 < k <= max_topk:
        raise ValueError(f"topk_idx has top-k {k}; it must lie in [1, max_topk={max_topk}]")
    if idx.numel():
        lo, hi = int(idx.min()), int(idx.max())
        if lo < -1 or hi >= num_experts:
            raise ValueError(
                f"topk_idx values must lie in [-1, {num_experts}); found {lo if lo < -1 else hi}"
            )
        ordered = idx.sort(dim=1).values
        repeated = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
        if repeated.any():
            row = int(torch.nonzero(repeated.any(dim=1))[0])
            raise ValueError(f"topk_idx row {row} lists the same expert twice: {idx[row].tolist()}")
    return idx.contiguous()


def topk_weights(value, shape: tuple[int, int], name: str = "topk_weights") -> torch.Tensor:
    """float32 with the given [rows, K] shape."""
    w = tensor(name, value, torch.float32, 2)
    if tuple(w.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(w.shape)}, expected {tuple(shape)}")
    return w.contiguous()


def layout_args(num_tokens_per_rank, is_token_in_rank, computed_is_token_in_rank: torch.Tensor) -> None:
    """Caller-supplied layout must be what topk_idx implies (ubep derives routing from it)."""
    R = computed_is_token_in_rank.shape[1]
    if is_token_in_rank is not None:
        given = tensor("is_token_in_rank", is_token_in_rank, torch.bool, 2)
        if not torch.equal(given, computed_is_token_in_rank):
            raise ValueError("is_token_in_rank does not match topk_idx (pass both from get_dispatch_layout)")
    if num_tokens_per_rank is not None:
        given = tensor("num_tokens_per_rank", num_tokens_per_rank, (torch.int32, torch.int64), 1)
        if given.numel() != R or not torch.equal(given.long(), computed_is_token_in_rank.sum(0)):
            raise ValueError("num_tokens_per_rank does not match topk_idx")


def positive(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value

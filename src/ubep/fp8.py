"""FP8 payloads: float8_e4m3fn values with per-token, per-128-channel float32 scales.

A token row x[n, :] of H channels is cut into H // 128 blocks; block b gets
`scale[n, b] = amax(|x[n, 128b : 128b + 128]|) / 448` (448 is e4m3's largest
finite value) and `values = x / scale`, rounded to nearest e4m3. An all-zero
block gets scale 0 and values 0. Dequantising multiplies back.

Error bound (tested in tests/api/test_fp8.py): e4m3 keeps 3 mantissa bits, so a
value in e4m3's normal range is rounded with relative error <= 2^-4; below it
(|x| / scale < 2^-6) the subnormal spacing 2^-9 gives absolute error <= 2^-10
in scaled units. Hence, elementwise,

    |dequantize(quantize(x)) - x| <= 2^-4 * |x| + 2^-10 * scale      (+ float32 rounding)

which is at most 2^-4 * amax of the block (6.25% of the block's largest value).

On the wire a pair travels as one byte row per token: H value bytes followed by
4 * H // 128 scale bytes (1.03 bytes per channel against bf16's 2).
"""

from __future__ import annotations

import torch

BLOCK = 128  # channels sharing one scale
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
VALUE_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float32
REL_ERROR = 2.0**-4  # bound on |error| / |x| in e4m3's normal range
SUBNORMAL_ERROR = 2.0**-10  # bound on |error| / scale below it

Fp8Pair = tuple[torch.Tensor, torch.Tensor]


def quantize(x_NH: torch.Tensor) -> Fp8Pair:
    """x [N, H] (any float dtype, H % 128 == 0) -> (values e4m3 [N, H], scales float32 [N, H // 128])."""
    if x_NH.dim() != 2 or x_NH.shape[1] % BLOCK:
        raise ValueError(f"quantize needs x [N, H] with H a multiple of {BLOCK}, got {tuple(x_NH.shape)}")
    N, H = x_NH.shape
    blocks_NBC = x_NH.float().view(N, H // BLOCK, BLOCK)
    scales_NB = blocks_NBC.abs().amax(dim=2) / E4M3_MAX
    safe_NB = torch.where(scales_NB > 0, scales_NB, torch.ones_like(scales_NB))
    scaled_NBC = (blocks_NBC / safe_NB.unsqueeze(2)).clamp(-E4M3_MAX, E4M3_MAX)
    return scaled_NBC.view(N, H).to(VALUE_DTYPE), scales_NB


def dequantize(
    values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """(values [..., H], scales [..., H // 128]) -> x [..., H] in `dtype` (float32 by default)."""
    if values.shape[-1] != scales.shape[-1] * BLOCK or values.shape[:-1] != scales.shape[:-1]:
        raise ValueError(
            f"values {tuple(values.shape)} and scales {tuple(scales.shape)} do not match "
            f"(scales need one column per {BLOCK} channels)"
        )
    blocks = values.float().unflatten(-1, (scales.shape[-1], BLOCK))
    return (blocks * scales.float().unsqueeze(-1)).flatten(-2).to(dtype)


def error_bound(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on |dequantize(quantize(x)) - x| (see the module docstring), float32."""
    scale_per_channel = scales.float().repeat_interleave(BLOCK, dim=-1)
    slack = 1 + 2.0**-20  # float32 rounding of the division and the product
    return (REL_ERROR * x.float().abs() + SUBNORMAL_ERROR * scale_per_channel) * slack


def is_pair(x) -> bool:
    """Whether `x` is a (values, scales) tuple rather than a plain tensor."""
    return isinstance(x, tuple | list) and len(x) == 2


def to_rows(values_NH: torch.Tensor, scales_NB: torch.Tensor) -> torch.Tensor:
    """The wire form: uint8 [N, H + 4 * H // 128], values then scales of each token."""
    N, nb = scales_NB.shape
    scale_bytes = scales_NB.reshape(-1).view(torch.uint8).view(N, 4 * nb)  # (flat first: N may be 0)
    return torch.cat([values_NH.view(torch.uint8), scale_bytes], dim=1)


def from_rows(rows_NX: torch.Tensor, hidden: int) -> Fp8Pair:
    """Inverse of `to_rows`: uint8 [N, H + 4 * H // 128] -> (values [N, H], scales [N, H // 128])."""
    N, nb = rows_NX.shape[0], hidden // BLOCK
    values = rows_NX[:, :hidden].contiguous().view(VALUE_DTYPE)
    scales = rows_NX[:, hidden:].contiguous().reshape(-1).view(SCALE_DTYPE).view(N, nb)
    return values, scales


def row_bytes(hidden: int) -> int:
    """Bytes of one token on the wire."""
    return hidden + 4 * (hidden // BLOCK)

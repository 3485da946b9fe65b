"""DeepEP's FP8 scale formats for low-latency dispatch: power-of-two scales and UE8M0 packing.

`round_scale=True` rounds each per-128-channel scale up to a power of two,
`2 ** ceil(log2(amax / 448))`, so dividing by it is exact in the exponent.
`use_ue8m0=True` then stores each scale as its 8 exponent bits (the float32 bits
>> 23) and packs 4 consecutive blocks into one int32, little end first: scales
[N, H // 128] -> int32 [N, H // 512]. Like DeepEP, received scales are laid out
column-major in their last two dimensions ([L, M, X] with strides (M * X, 1, M)).
Example: amax 100 -> 100 / 448 = 0.223 -> scale 0.25 = 2^-2, UE8M0 byte 125.
"""

from __future__ import annotations

import torch

from ubep import fp8

AMAX_FLOOR = 1e-4  # DeepEP's margin: an all-zero block still gets a finite scale
BLOCKS_PER_WORD = 4  # UE8M0 bytes per packed int32


def quantize_pow2(x_NH: torch.Tensor) -> fp8.Fp8Pair:
    """x [N, H] -> (values e4m3 [N, H], power-of-two scales float32 [N, H // 128])."""
    N, H = x_NH.shape
    blocks_NBC = x_NH.float().view(N, H // fp8.BLOCK, fp8.BLOCK)
    amax_NB = blocks_NBC.abs().amax(dim=2).clamp_min(AMAX_FLOOR)
    scales_NB = torch.exp2(torch.ceil(torch.log2(amax_NB / fp8.E4M3_MAX)))
    values_NBC = (blocks_NBC / scales_NB.unsqueeze(2)).clamp(-fp8.E4M3_MAX, fp8.E4M3_MAX)
    return values_NBC.view(N, H).to(fp8.VALUE_DTYPE), scales_NB


def pack_ue8m0(scales_NB: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales [..., B] (B % 4 == 0) -> int32 [..., B // 4] of exponent bytes."""
    exponent = (scales_NB.float().contiguous().view(torch.int32) >> 23) & 0xFF
    shifts = torch.arange(BLOCKS_PER_WORD, dtype=torch.int64, device=scales_NB.device) * 8
    word = (exponent.unflatten(-1, (-1, BLOCKS_PER_WORD)).to(torch.int64) << shifts).sum(dim=-1)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)  # the same 32 bits, signed


def unpack_ue8m0(packed_NW: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_ue8m0`: int32 [..., W] -> float32 scales [..., 4 W]."""
    shifts = torch.arange(BLOCKS_PER_WORD, dtype=torch.int32, device=packed_NW.device) * 8
    exponent = (packed_NW.unsqueeze(-1) >> shifts) & 0xFF
    return (exponent << 23).view(torch.float32).flatten(-2)


def column_major(t_LMX: torch.Tensor) -> torch.Tensor:
    """The same values with the last two dimensions stored column-major (DeepEP's scale layout)."""
    return t_LMX.transpose(-1, -2).contiguous().transpose(-1, -2)

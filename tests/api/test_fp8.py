"""FP8 (e4m3 + per-128-channel scales): the error bound, and FP8 pairs through normal dispatch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from scenarios import Scenario

import ubep
from ubep import fp8
from ubep.transport.virtual import VirtualWorld


def test_quantize_meets_the_documented_bound():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 512, generator=gen) * torch.logspace(-6, 4, 64).unsqueeze(1)  # many magnitudes
    x[3, 128:256] = 0.0  # an all-zero block
    x[5, :7] = 1e-30  # values far below the block's amax (subnormal range)
    values, scales = fp8.quantize(x.bfloat16())
    assert values.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert tuple(scales.shape) == (64, 4)
    xf = x.bfloat16().float()
    amax = xf.view(64, 4, 128).abs().amax(dim=2)
    assert torch.equal(scales, amax / fp8.E4M3_MAX)  # scales are exactly amax / 448
    err = (fp8.dequantize(values, scales) - xf).abs()
    assert (err <= fp8.error_bound(xf, scales)).all()
    assert (err <= fp8.REL_ERROR * amax.repeat_interleave(128, dim=1) * (1 + 1e-6)).all()  # <= 6.25% of amax
    assert torch.equal(fp8.dequantize(values, scales)[3, 128:256], torch.zeros(128))
    assert fp8.dequantize(values, scales, torch.bfloat16).dtype == torch.bfloat16


def test_the_bound_is_tight_and_wire_rows_round_trip():
    x = torch.tensor([[448.0, 17.0] + [0.0] * 126])  # scale 1; 17 is a tie between e4m3's 16 and 18
    values, scales = fp8.quantize(x)
    err = (fp8.dequantize(values, scales) - x).abs()[0, 1]
    assert err == 1.0 and err > 0.9 * fp8.REL_ERROR * 17  # the bound is nearly attained
    rows = fp8.to_rows(values, scales)
    assert tuple(rows.shape) == (1, fp8.row_bytes(128)) and rows.dtype == torch.uint8
    back_v, back_s = fp8.from_rows(rows, 128)
    assert torch.equal(back_v.view(torch.uint8), values.view(torch.uint8)) and torch.equal(back_s, scales)
    empty = fp8.quantize(torch.zeros(0, 256))
    assert tuple(fp8.from_rows(fp8.to_rows(*empty), 256)[1].shape) == (0, 2)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8.quantize(torch.zeros(2, 100))
    with pytest.raises(ValueError, match="do not match"):
        fp8.dequantize(torch.zeros(2, 256).to(torch.float8_e4m3fn), torch.ones(2, 3))


def fp8_normal_dispatch(combos) -> int:
    """An FP8 pair through normal dispatch (and cached dispatch) equals the bf16 routing of its bytes."""
    me = dist.get_rank() if dist.is_initialized() else 0
    R = dist.get_world_size() if dist.is_initialized() else 1
    sc = Scenario(name="fp8", num_ranks=R, num_experts=4 * R, hidden=256, drop=0.2, seed=9)
    xs, idxs, ws, ref = sc.expected()
    pairs = [fp8.quantize(x) for x in xs]
    for protocol, transport in combos:
        with ubep.Buffer(
            hidden=256,
            num_experts=4 * R,
            max_tokens_per_rank=sc.capacity,
            protocol=protocol,
            transport=transport,
        ) as buf:
            got = buf.dispatch(pairs[me], topk_idx=idxs[me], topk_weights=ws[me])
            values, scales = got.recv_x
            rows = [ref[me].src_token_M[ref[me].src_rank_M == r] for r in range(R)]  # source-major
            want_v = torch.cat([pairs[r][0][rows[r]] for r in range(R)])
            want_s = torch.cat([pairs[r][1][rows[r]] for r in range(R)])
            assert torch.equal(values.view(torch.uint8), want_v.view(torch.uint8))
            assert torch.equal(scales, want_s)
            assert torch.equal(got.recv_topk_idx, ref[me].recv_topk_idx_MK)
            again = buf.dispatch((pairs[me][0], pairs[me][1] * 2), handle=got.handle)
            assert torch.equal(again.recv_x[1], scales * 2)
            assert torch.equal(again.recv_x[0].view(torch.uint8), values.view(torch.uint8))
    return len(combos)


def test_fp8_pairs_through_normal_dispatch():
    combos = [("ubep", "shm"), ("bsp", "shm"), ("bsp", "dist")]
    assert ubep.LocalLaunch(world_size=2, timeout_s=120).run(fp8_normal_dispatch, combos) == [3, 3]


def test_fp8_pairs_on_one_rank_and_bad_pairs():
    assert fp8_normal_dispatch([("ubep", "auto")]) == 1
    with ubep.Buffer(hidden=256, num_experts=4, max_tokens_per_rank=4) as buf:
        idx, w = torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1)
        values, scales = fp8.quantize(torch.ones(2, 256))
        with pytest.raises(ValueError, match=r"x\[1\] \(scales\) must have shape"):
            buf.dispatch((values, scales[:, :1]), topk_idx=idx, topk_weights=w)
        with pytest.raises(TypeError, match=r"x\[0\] must be float8_e4m3fn"):
            buf.dispatch((values.float(), scales), topk_idx=idx, topk_weights=w)


def fp8_pairs_of_odd_strides(rank, protocol: str) -> bool:
    """Hidden 128 (one scale column): rank 0 sends no token, its scales [0, 1] as fp8.quantize makes
    them (stride (1, 0)); rank 1 sends scales whose last stride is not 1 ([N, 1], transposed)."""
    me, R, H = rank.rank, rank.world_size, fp8.BLOCK
    sc = Scenario(name="fp8-strides", num_ranks=R, num_experts=2 * R, hidden=H, tokens=(0, 5), seed=3)
    xs, idxs, ws, ref = sc.expected()
    pairs = [fp8.quantize(x) for x in xs]
    values, scales = pairs[me]
    if me == 1:
        scales = scales.reshape(1, -1).t()  # the same numbers, strides (1, N)
        assert scales.stride() == (1, scales.shape[0])
    with ubep.Buffer(
        rank, hidden=H, num_experts=2 * R, max_tokens_per_rank=8, protocol=protocol, engine="torch"
    ) as buf:
        got = buf.dispatch((values, scales), topk_idx=idxs[me], topk_weights=ws[me])
        again = buf.dispatch((values, scales), handle=got.handle)
    rows = [ref[me].src_token_M[ref[me].src_rank_M == r] for r in range(R)]
    want_v = torch.cat([pairs[r][0][rows[r]] for r in range(R)]).view(torch.uint8)
    want_s = torch.cat([pairs[r][1][rows[r]] for r in range(R)])
    return all(
        torch.equal(out.recv_x[0].view(torch.uint8), want_v) and torch.equal(out.recv_x[1], want_s)
        for out in (got, again)
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("protocol", ["bsp", "ubep"])
def test_fp8_pairs_of_no_tokens_or_odd_scale_strides(protocol):
    """Issue 32, item 8: bsp on the torch engine raised "self.stride(-1) must be 1 to view Float
    as Byte" for fp8.quantize's scales of 0 tokens at hidden 128."""
    world = VirtualWorld(2, timeout_s=60)
    assert world.run(lambda rank: fp8_pairs_of_odd_strides(rank, protocol)) == [True, True]

"""DeepEP's documented semantics through `ubep.compat.deep_ep`, checked against independent references.

The expected values come from DeepEP's definitions (deep_ep/buffers/legacy.py and
its intranode / low-latency kernels), written out here as plain loops:
handle tuples, dispatch by is_token_in_rank alone, num_worst_tokens padding,
combine bias, zero-copy low-latency combine, power-of-two and UE8M0 scales.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ubep
from ubep import fp8, reference, routing
from ubep.compat import deep_ep
from ubep.compat.deep_ep import Buffer, EventHandle, EventOverlap, scales

H, L, K, T = 512, 2, 2, 6  # hidden, local experts per rank, top-k, max tokens per rank
CHANNELS = 3  # Config(num_sms=6): DeepEP cuts each rank's tokens into 3 channels


def inputs(R: int, seed: int):
    """Every rank's (x, topk_idx, topk_weights), the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    ns = [int(n) for n in torch.randint(1, T + 1, (R,), generator=gen)]
    xs = [torch.randn(n, H, generator=gen).bfloat16() for n in ns]
    idxs = [routing.drop(routing.uniform(n, L * R, K, gen), 0.2, gen) for n in ns]
    return xs, idxs, [routing.weights(n, K, gen) for n in ns]


def in_rank(idx_NK: torch.Tensor, R: int) -> torch.Tensor:
    owner = torch.where(idx_NK >= 0, idx_NK // L, -1)
    return torch.stack([(owner == r).any(dim=1) for r in range(R)], dim=1)


def per_expert(idx_NK: torch.Tensor, E: int) -> torch.Tensor:
    return torch.bincount(idx_NK[idx_NK >= 0], minlength=E).int()


# ---- DeepEP's handle, by its definitions -------------------------------------------------------


def channel_ranges(n: int) -> list[range]:
    per = max(1, -(-n // CHANNELS))
    return [range(min(c * per, n), min(c * per + per, n)) for c in range(CHANNELS)]


def expected_handle(sent: list[torch.Tensor], me: int):
    """(rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, send_head) by loops."""
    R = len(sent)
    rank_prefix = torch.zeros(R, R, dtype=torch.int32)
    for i in range(R):
        for j in range(R):
            rank_prefix[i, j] = sum(int(sent[s][:, j].sum()) for s in range(i + 1))
    channel_prefix = torch.zeros(R, CHANNELS, dtype=torch.int32)
    send_head = torch.full(sent[me].shape, -1, dtype=torch.int32)
    for r in range(R):
        total = 0
        for c, tokens in enumerate(channel_ranges(sent[me].shape[0])):
            position = 0
            for t in tokens:
                if sent[me][t, r]:
                    send_head[t, r] = position
                    position += 1
            total += position
            channel_prefix[r, c] = total
    recv_channel = torch.zeros(R, CHANNELS, dtype=torch.int32)
    for s in range(R):
        start = 0
        for c, tokens in enumerate(channel_ranges(sent[s].shape[0])):
            recv_channel[s, c] = start
            start += sum(int(sent[s][t, me]) for t in tokens)
    return rank_prefix, channel_prefix, recv_channel, send_head


def experts(x: torch.Tensor, rank: int) -> torch.Tensor:
    return (x.float() * (0.5 + rank)).bfloat16()


def normal_checks(group, me: int, R: int) -> None:
    E = L * R
    xs, idxs, ws = inputs(R, seed=3)
    sent = [in_rank(i, R) for i in idxs]
    ref = reference.dispatch(xs, idxs, ws, E)
    ns = [x.shape[0] for x in xs]
    config = deep_ep.Config(num_sms=2 * CHANNELS)
    buffer = Buffer(group, Buffer.get_dispatch_config(R).get_nvl_buffer_size_hint(H * 2, R))

    # the handle unpacks like DeepEP's 6-tuple, and keeps ubep's names
    per_rank, _, per_exp, in_rank_NR, _ = buffer.get_dispatch_layout(idxs[me], E)
    recv_x, recv_idx, recv_w, counts, handle, event = buffer.dispatch(
        xs[me], None, per_rank, None, in_rank_NR, per_exp, idxs[me], ws[me], config=config
    )
    assert event.event is None and len(handle) == 6
    rank_prefix, channel_prefix, recv_channel, recv_src_idx, is_token_in_rank, send_head = handle
    want = expected_handle(sent, me)
    assert torch.equal(rank_prefix, want[0]) and torch.equal(channel_prefix, want[1])
    assert torch.equal(recv_channel, want[2]) and torch.equal(send_head, want[3])
    assert torch.equal(recv_src_idx, ref[me].src_token_M.int()) and torch.equal(is_token_in_rank, sent[me])
    assert handle[3] is recv_src_idx and torch.equal(handle.recv_src_rank_M, ref[me].src_rank_M)
    assert handle.num_tokens == ns[me] and torch.equal(recv_x, ref[me].recv_x_MH)

    # a cached dispatch returns DeepEP's (recv_x, None, None, None, None, event)
    again = buffer.dispatch(xs[me] * 2, handle=handle, async_finish=True)
    assert torch.equal(again[0], ref[me].recv_x_MH * 2) and again[1:5] == (None,) * 4
    assert isinstance(again[5].event, EventHandle) and again[5].extra_tensors is None

    # combine with one and two bias tensors: added in float32 on the home rank, one rounding
    ys = [experts(r.recv_x_MH, rank) for rank, r in enumerate(ref)]
    sums = reference.combine([y.float() for y in ys], ref, ns)
    gen = torch.Generator().manual_seed(5)
    b0s = [torch.randn(n, H, generator=gen).bfloat16() for n in ns]
    b1s = [torch.randn(n, H, generator=gen).bfloat16() for n in ns]
    one, _, _ = buffer.combine(experts(recv_x, me), handle, bias=b0s[me])
    two, _, event = buffer.combine(experts(recv_x, me), handle, bias=(b0s[me], b1s[me]), async_finish=True)
    event.current_stream_wait()
    assert torch.equal(one, (sums[me] + b0s[me].float()).bfloat16())
    assert torch.equal(two, (sums[me] + b0s[me].float() + b1s[me].float()).bfloat16())

    # routed by is_token_in_rank alone: same rows, no top-k outputs, counts from num_tokens_per_expert
    recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
        xs[me],
        num_tokens_per_rank=per_rank,
        is_token_in_rank=sent[me],
        num_tokens_per_expert=per_exp,
        expert_alignment=4,
    )
    assert recv_idx is None and recv_w is None and torch.equal(recv_x, ref[me].recv_x_MH)
    arrived = sum(per_expert(i, E)[me * L : (me + 1) * L] for i in idxs)
    assert counts == [-(-int(c) // 4) * 4 for c in arrived]
    combined, _, _ = buffer.combine(experts(recv_x, me), handle)
    assert torch.equal(combined, reference.combine(ys, ref, ns)[me])

    # num_worst_tokens: fixed-size outputs, padding marked by recv_topk_idx == -1, empty counts list
    W = sum(ns)
    recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
        xs[me],
        num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank_NR,
        num_tokens_per_expert=per_exp,
        topk_idx=idxs[me],
        topk_weights=ws[me],
        num_worst_tokens=W,
    )
    M = ref[me].recv_x_MH.shape[0]
    assert recv_x.shape == (W, H) and recv_idx.shape == (W, K) and counts == []
    assert torch.equal(recv_x[:M], ref[me].recv_x_MH) and torch.equal(recv_idx[:M], ref[me].recv_topk_idx_MK)
    assert bool((recv_idx[M:] == -1).all()) and bool((recv_w[M:] == 0).all())
    assert handle.recv_src_idx.shape == (W,)
    y = experts(recv_x, me)
    y[M:] = float("nan")  # the padding rows are never read
    combined, _, _ = buffer.combine(y, handle)
    assert torch.equal(combined, reference.combine(ys, ref, ns)[me])
    cached = buffer.dispatch(xs[me], handle=handle)[0]
    assert cached.shape == (W, H) and torch.equal(cached[:M], ref[me].recv_x_MH)
    most = int(torch.cat(sent).sum(dim=0).max())  # the most rows any rank receives
    assert most >= 2
    with pytest.raises(ValueError, match=r"num_worst_tokens=\d+ is fewer than"):  # on every rank
        buffer.dispatch(
            xs[me],
            num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank_NR,
            num_tokens_per_expert=per_exp,
            topk_idx=idxs[me],
            topk_weights=ws[me],
            num_worst_tokens=most - 1,
        )
    buffer.destroy()


def low_latency_checks(group, me: int, R: int) -> None:
    E = L * R
    xs, idxs, ws = inputs(R, seed=4)
    hint = Buffer.get_low_latency_rdma_size_hint(T, H, R, E)
    buffer = Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=L)
    ref = reference.low_latency_dispatch(xs, idxs, E, T)

    # the handle unpacks like DeepEP's 5-tuple
    recv_x, recv_count, handle, event, hook = buffer.low_latency_dispatch(
        xs[me], idxs[me], T, E, use_fp8=False, return_recv_hook=True
    )
    hook()
    assert event.event is None and len(handle) == 5
    src_info, layout_range, t, hidden, num_experts = handle
    assert (t, hidden, num_experts) == (T, H, E) and handle.num_local_experts == L
    valid = ref[me].src_token_LM >= 0
    assert torch.equal(src_info[valid], ref[me].src_token_LM[valid].int()) and src_info.dtype == torch.int32
    begin, count = ref[me].layout_range_LR2.unbind(dim=2)
    assert torch.equal(layout_range, begin * 2**32 + count)
    assert torch.equal(recv_x[valid], ref[me].recv_x_LMX[valid])

    # zero copy: the combine reads the buffer the caller filled, not x
    ys = [experts(r.recv_x_LMX, rank) for rank, r in enumerate(ref)]
    want = reference.low_latency_combine(ys, ref, idxs, ws)[me]
    buffer.get_next_low_latency_combine_buffer(handle).copy_(experts(recv_x, me))
    combined, event, _ = buffer.low_latency_combine(
        torch.zeros_like(recv_x), idxs[me], ws[me], handle, zero_copy=True, async_finish=True
    )
    event.current_stream_wait()
    assert torch.equal(combined, want) and isinstance(event.extra_tensors, tuple)
    combined, _, _ = buffer.low_latency_combine(
        experts(recv_x, me), idxs[me], ws[me], handle, use_logfmt=True
    )
    assert torch.equal(combined, want)
    with pytest.raises(ValueError, match="zero_copy=True and use_logfmt=True"):
        buffer.low_latency_combine(recv_x, idxs[me], ws[me], handle, use_logfmt=True, zero_copy=True)

    # FP8: plain scales column-major; round_scale gives powers of two; use_ue8m0 packs their exponents
    (values, plain), _, _, _, _ = buffer.low_latency_dispatch(xs[me], idxs[me], T, E)
    M, B = R * T, H // fp8.BLOCK
    assert plain.shape == (L, M, B) and plain.transpose(1, 2).is_contiguous()  # column-major
    (v2, pow2), _, _, _, _ = buffer.low_latency_dispatch(xs[me], idxs[me], T, E, round_scale=True)
    (v8, packed), _, _, _, _ = buffer.low_latency_dispatch(
        xs[me], idxs[me], T, E, round_scale=True, use_ue8m0=True
    )
    assert packed.dtype == torch.int32 and packed.shape == (L, M, B // 4)
    assert packed.transpose(1, 2).is_contiguous() and pow2.transpose(1, 2).is_contiguous()
    x_v = ref[me].recv_x_LMX[valid].float()
    s_v = pow2[valid]
    mantissa, exponent = torch.frexp(s_v)
    amax = x_v.view(-1, B, fp8.BLOCK).abs().amax(dim=2).clamp_min(1e-4)
    assert (
        bool((mantissa == 0.5).all()) and bool((s_v >= amax / 448).all()) and bool((s_v < amax / 224).all())
    )
    back = fp8.dequantize(v2[valid], s_v)
    assert bool(((back - x_v).abs() <= 2**-4 * x_v.abs() + 2**-10 * s_v.repeat_interleave(128, 1)).all())
    assert torch.equal(v8[valid].view(torch.uint8), v2[valid].view(torch.uint8))
    bytes_ = torch.stack([(packed[valid] >> (8 * i)) & 0xFF for i in range(4)], dim=-1).flatten(1)
    assert torch.equal(bytes_, (exponent - 1 + 127).to(torch.int32))
    with pytest.raises(ValueError, match="use_ue8m0=True needs round_scale=True"):
        buffer.low_latency_dispatch(xs[me], idxs[me], T, E, use_ue8m0=True)
    buffer.destroy()


def semantics_program() -> bool:
    me, R = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(R)))
    normal_checks(group, me, R)
    low_latency_checks(group, me, R)
    return True


@pytest.mark.parametrize("ranks", [2, 4])
def test_deep_ep_semantics(ranks: int):
    assert ubep.LocalLaunch(world_size=ranks, timeout_s=150).run(semantics_program) == [True] * ranks


def test_ue8m0_packing_by_hand():
    s = torch.tensor([[2.0**-2, 1.0, 2.0**3, 2.0**-7, 0.5, 4.0, 2.0**-20, 2.0]])
    packed = scales.pack_ue8m0(s)
    assert packed.shape == (1, 2)
    assert int(packed[0, 0]) & 0xFF == 125 and (int(packed[0, 0]) >> 8) & 0xFF == 127
    assert (int(packed[0, 0]) >> 16) & 0xFF == 130 and (int(packed[0, 0]) >> 24) & 0xFF == 120
    assert torch.equal(scales.unpack_ue8m0(packed), s)
    x = torch.full((1, 128), 96.0)
    x[0, 0] = -100.0  # amax 100: 100 / 448 = 0.223 rounds up to 0.25
    values, pow2 = scales.quantize_pow2(x)
    assert float(pow2) == 0.25 and float(values[0, 1].float()) == 384.0


def test_surface_and_refusals():
    assert deep_ep.topk_idx_t is torch.int64 and Buffer.is_sm90_compiled() is False
    captured = Buffer.capture()
    assert isinstance(captured, EventOverlap) and isinstance(captured.event, EventHandle)
    with captured:
        pass
    from ubep.compat.deep_ep import utils

    assert utils.EventOverlap is EventOverlap and utils.EventHandle is EventHandle
    buffer = Buffer(None, num_rdma_bytes=1 << 20, low_latency_mode=True)
    with pytest.raises(ValueError, match="enable_shrink=True"):
        buffer.low_latency_update_mask_buffer(0, True)
    # FP8 in the hint: DeepEP's callers pass hidden * max(element_size, 2), the same for bf16 and FP8;
    # one byte a channel plus scales sizes for about half the hidden size
    # (tests/compat/test_deep_ep_sizing.py)
    hint_fp8 = deep_ep.Config().get_nvl_buffer_size_hint(7168 + 7168 // 32, 8)
    hint_bf16 = deep_ep.Config().get_nvl_buffer_size_hint(7168 * 2, 8)
    assert 0 < hint_fp8 < hint_bf16

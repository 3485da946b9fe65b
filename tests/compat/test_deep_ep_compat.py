"""A short MoE layer written the way DeepEP's users write it; only the import differs.

The helpers below follow DeepEP's documented usage (size the buffer from the
config hints, get_dispatch_layout -> dispatch -> experts -> combine; for decode,
size by get_low_latency_rdma_size_hint and use the receive hooks).
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
from repo import ROOT

import ubep
from ubep import fp8, reference, routing
from ubep.compat.deep_ep import Buffer, EventOverlap  # was: from deep_ep import Buffer, EventOverlap

HIDDEN, NUM_EXPERTS_PER_RANK, TOPK, T = 256, 2, 2, 8


# ---- user code, as written against DeepEP -------------------------------------------------------


def get_buffer(group: dist.ProcessGroup, hidden_bytes: int) -> Buffer:
    num_nvl_bytes, num_rdma_bytes = 0, 0
    for config in (Buffer.get_dispatch_config(group.size()), Buffer.get_combine_config(group.size())):
        num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, group.size()), num_nvl_bytes)
        num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, group.size()), num_rdma_bytes)
    return Buffer(group, num_nvl_bytes, num_rdma_bytes)


def dispatch_forward(buffer: Buffer, x, topk_idx, topk_weights, num_experts, previous_event=None):
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, previous_event = (
        buffer.get_dispatch_layout(
            topk_idx,
            num_experts,
            previous_event=previous_event,
            async_finish=True,
            allocate_on_comm_stream=previous_event is not None,
        )
    )
    recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event = (
        buffer.dispatch(
            x,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
            is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert,
            previous_event=previous_event,
            async_finish=True,
            allocate_on_comm_stream=True,
        )
    )
    return recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event


def combine_forward(buffer: Buffer, x, handle, previous_event=None):
    combined_x, _, event = buffer.combine(
        x,
        handle,
        async_finish=True,
        previous_event=previous_event,
        allocate_on_comm_stream=previous_event is not None,
    )
    return combined_x, event


def get_ll_buffer(group, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> Buffer:
    num_rdma_bytes = Buffer.get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank, hidden, group.size(), num_experts
    )
    return Buffer(
        group,
        num_rdma_bytes=num_rdma_bytes,
        low_latency_mode=True,
        num_qps_per_rank=num_experts // group.size(),
    )


def ll_dispatch(buffer: Buffer, hidden_states, topk_idx, num_max_dispatch_tokens_per_rank, num_experts):
    recv_hidden_states, recv_expert_count, handle, event, hook = buffer.low_latency_dispatch(
        hidden_states,
        topk_idx,
        num_max_dispatch_tokens_per_rank,
        num_experts,
        async_finish=False,
        return_recv_hook=True,
    )
    return recv_hidden_states, recv_expert_count, handle, event, hook


def ll_combine(buffer: Buffer, hidden_states, topk_idx, topk_weights, handle):
    combined_hidden_states, event_overlap, hook = buffer.low_latency_combine(
        hidden_states, topk_idx, topk_weights, handle, async_finish=False, return_recv_hook=True
    )
    return combined_hidden_states, event_overlap, hook


def experts(x: torch.Tensor, rank: int) -> torch.Tensor:
    return (x.float() * (1.5 + rank)).bfloat16()


# ---- the checks ---------------------------------------------------------------------------------


def inputs(R: int, E: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    ns = [int(n) for n in torch.randint(1, T + 1, (R,), generator=gen)]
    xs = [torch.randn(n, HIDDEN, generator=gen).bfloat16() for n in ns]
    idxs = [routing.drop(routing.uniform(n, E, TOPK, gen), 0.1, gen) for n in ns]
    return xs, idxs, [routing.weights(n, TOPK, gen) for n in ns]


def normal_layer(group, me: int, R: int) -> None:
    E = NUM_EXPERTS_PER_RANK * R
    xs, idxs, ws = inputs(R, E, seed=1)
    Buffer.set_num_sms(24)
    buffer = get_buffer(group, HIDDEN * 2)
    recv_x, _, _, counts, handle, event = dispatch_forward(buffer, xs[me], idxs[me], ws[me], E)
    event.current_stream_wait()
    ref = reference.dispatch(xs, idxs, ws, E)
    assert torch.equal(recv_x, ref[me].recv_x_MH) and counts == ref[me].num_recv_tokens_per_expert
    combined_x, event = combine_forward(buffer, experts(recv_x, me), handle, previous_event=event)
    with event:
        pass
    ys = [experts(r.recv_x_MH, rank) for rank, r in enumerate(ref)]
    assert torch.equal(combined_x, reference.combine(ys, ref, [x.shape[0] for x in xs])[me])
    buffer.destroy()


def low_latency_layer(group, me: int, R: int) -> None:
    E = NUM_EXPERTS_PER_RANK * R
    buffer = get_ll_buffer(group, T, HIDDEN, E)
    buffer.clean_low_latency_buffer(T, HIDDEN, E)
    xs, idxs, ws = inputs(R, E, seed=2)
    (values, scales), recv_count, handle, _, hook = ll_dispatch(
        buffer, xs[me], idxs[me], T, E
    )  # FP8 by default
    hook()
    qs = [fp8.quantize(x) for x in xs]
    ref_v = reference.low_latency_dispatch([q[0] for q in qs], idxs, E, T)
    ref_s = reference.low_latency_dispatch([q[1] for q in qs], idxs, E, T)
    assert torch.equal(recv_count, ref_v[me].recv_count_L)
    ys = [
        experts(fp8.dequantize(v.recv_x_LMX, s.recv_x_LMX), r)
        for r, (v, s) in enumerate(zip(ref_v, ref_s, strict=True))
    ]
    y = buffer.get_next_low_latency_combine_buffer(handle)
    y.copy_(experts(fp8.dequantize(values, scales), me))
    combined, _, hook = ll_combine(buffer, y, idxs[me], ws[me], handle)
    hook()
    assert torch.equal(combined, reference.low_latency_combine(ys, ref_v, idxs, ws)[me])
    with pytest.raises(ValueError, match=r"num_rdma_bytes=\d+ is too small"):
        buffer.low_latency_dispatch(xs[me], idxs[me], 2 * T, E)
    buffer.destroy()


def deep_ep_program() -> bool:
    me, R = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(R)))
    normal_layer(group, me, R)
    low_latency_layer(group, me, R)
    return isinstance(Buffer.capture(), EventOverlap)


def test_a_deep_ep_program_runs_unchanged():
    assert ubep.LocalLaunch(world_size=2, timeout_s=120).run(deep_ep_program) == [True, True]


def test_sizes_and_refusals():
    hint = Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256)
    assert hint > 2 * 32 * 8 * 128 * 7168 * 2  # both halves of every (expert, source) slot, at least bf16
    assert Buffer.get_dispatch_config(8).get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    with pytest.raises(ValueError, match="even"):
        Buffer.set_num_sms(7)
    buffer = Buffer(None, num_nvl_bytes=1024)
    with pytest.raises(ValueError, match="low_latency_mode=True"):
        buffer.low_latency_dispatch(
            torch.zeros(1, 128).bfloat16(), torch.zeros(1, 1, dtype=torch.int64), 1, 1
        )
    with pytest.raises(ValueError, match="holds no token"):
        buffer.dispatch(
            torch.zeros(1, 128).bfloat16(), num_tokens_per_expert=torch.ones(1, dtype=torch.int32)
        )
    with pytest.raises(ValueError, match="use_ue8m0=True needs round_scale=True"):
        Buffer(None, low_latency_mode=True).low_latency_dispatch(
            torch.zeros(1, 512).bfloat16(), torch.zeros(1, 1, dtype=torch.int64), 1, 1, use_ue8m0=True
        )


def test_local_buffer_tensor_and_comm_stream_as_in_deep_ep_v1():
    buffer = Buffer(None, num_nvl_bytes=1024, num_rdma_bytes=512, low_latency_mode=True)
    stream = buffer.get_comm_stream()
    assert isinstance(stream, torch.Stream) and stream.query()  # calls finish in program order
    words = buffer.get_local_buffer_tensor(torch.int32)
    assert words.dtype == torch.int32 and words.numel() == 1024 // 4
    words[1:4] = torch.tensor([5, 6, 7], dtype=torch.int32)
    view = buffer.get_local_buffer_tensor(torch.int32, torch.Size([1, 2]), offset=8)  # offset in bytes
    assert view.tolist() == [[6, 7]]  # the same memory, every request
    assert buffer.get_local_buffer_tensor(torch.bfloat16, offset=1000).numel() == 12  # ends at the end
    assert buffer.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True).numel() == 512
    with pytest.raises(ValueError, match=r"multiple of torch\.int32's 4 bytes"):
        buffer.get_local_buffer_tensor(torch.int32, offset=2)
    with pytest.raises(ValueError, match=r"offset must be an int in \[0, 1024\]"):
        buffer.get_local_buffer_tensor(torch.int32, offset=1028)
    with pytest.raises(ValueError, match=r"size \(300,\) needs 300 elements; the buffer holds 256"):
        buffer.get_local_buffer_tensor(torch.int32, torch.Size([300]))


def test_the_documented_fp8_defaults_match_the_code():
    with open(ROOT / "docs" / "frameworks.md") as doc:
        text = " ".join(doc.read().split())
    ours = inspect.signature(ubep.Buffer.low_latency_dispatch).parameters["use_fp8"].default
    theirs = inspect.signature(Buffer.low_latency_dispatch).parameters["use_fp8"].default
    assert f"including DeepEP's default, `use_fp8={theirs}`, in `low_latency_dispatch`" in text
    assert f"`ubep.Buffer.low_latency_dispatch` defaults to `use_fp8={ours}`" in text
    assert "The layer covers both of DeepEP's Python APIs" in text  # V1's Buffer and V2's ElasticBuffer
    assert "is not covered" not in text  # section 1 once said V2 was not, while section 1b covered it

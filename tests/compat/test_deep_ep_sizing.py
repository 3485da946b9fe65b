"""The DeepEP layer's size hints are what ubep maps for their shapes and no more, and a Buffer too big
for the host says so, in DeepEP's terms and with the figures, before it maps anything.

The figures are `ubep.sizing.size_hint`'s (the public statement of what a Buffer maps) and the
capacity a hint's bytes give, seen through what a dispatch accepts.
"""

from __future__ import annotations

import os

import pytest
import torch

import ubep
from ubep.compat.deep_ep import Buffer, Config
from ubep.errors import SharedMemorySizeError
from ubep.sizing import size_hint
from ubep.transport import segments as shm

HINT_TOKENS, LL_TOPK = 4096, 11  # DeepEP's prefill size; its low-latency kernels' top-k limit


def test_normal_hint_is_the_segment_for_4096_tokens_of_hidden_bytes_over_two():
    for hidden, ranks in ((7168, 2), (7168, 8), (4096, 4)):
        hint = Config().get_nvl_buffer_size_hint(hidden * 2, ranks)  # DeepEP's bf16 (and FP8) hidden_bytes
        want = size_hint(hidden=hidden, num_experts=ranks, max_tokens_per_rank=HINT_TOKENS, num_ranks=ranks,
                         max_topk=16, low_latency=False)  # fmt: skip
        assert hint == want.segment_bytes, (hidden, ranks)


def test_a_normal_hint_holds_4096_tokens_and_not_one_more():
    H = 64
    buf = Buffer(None, Config().get_nvl_buffer_size_hint(H * 2, 1))
    for n, fits in ((HINT_TOKENS, True), (HINT_TOKENS + 1, False)):
        x, idx = torch.randn(n, H).bfloat16(), torch.zeros(n, 1, dtype=torch.int64)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 1)
        args = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                    topk_idx=idx, topk_weights=torch.ones(n, 1))  # fmt: skip
        if fits:
            assert buf.dispatch(x, **args)[0].shape == (n, H)
        else:
            with pytest.raises(
                ValueError, match=f"x has {n} tokens; num_nvl_bytes=.* holds {HINT_TOKENS} tokens"
            ):
                buf.dispatch(x, **args)
    buf.destroy()


def test_low_latency_hint_is_the_segment_at_deep_eps_top_k_limit():
    hint = Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256)
    want = size_hint(
        hidden=7168, num_experts=256, max_tokens_per_rank=128, num_ranks=8, max_topk=LL_TOPK, low_latency=True
    )
    assert hint == want.segment_bytes
    buf = Buffer(
        None, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(4, 64, 1, 16), low_latency_mode=True
    )
    x = torch.randn(4, 64).bfloat16()
    for k, fits in ((LL_TOPK, True), (LL_TOPK + 1, False)):
        idx = torch.stack([torch.randperm(16)[:k] for _ in range(4)])
        if fits:
            assert buf.low_latency_dispatch(x, idx, 4, 16, use_fp8=False)[1].sum() == 4 * k
        else:
            with pytest.raises(ValueError, match=f"top-k {k}; it must lie in \\[1, max_topk={LL_TOPK}\\]"):
                buf.low_latency_dispatch(x, idx, 4, 16, use_fp8=False)
    buf.destroy()


def too_big_for_the_host() -> str:
    """A 2-rank compat Buffer sized by the hint on a host said to have 1 MiB of memory to give."""
    shm.memory_free_bytes = lambda: 1 << 20  # in this rank process only: what /proc/meminfo would say
    H, group = 7168, torch.distributed.group.WORLD
    buf = Buffer(group, Config().get_nvl_buffer_size_hint(H * 2, 2))
    x, idx = torch.randn(4, H).bfloat16(), torch.zeros(4, 1, dtype=torch.int64)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 2)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    try:
        buf.dispatch(x, **layout, topk_idx=idx, topk_weights=torch.ones(4, 1))
    except SharedMemorySizeError as error:
        left = [n for n in os.listdir(shm.SHM_DIR) if n.startswith(shm.NAME_PREFIX)]
        return f"{error} | needed {error.needed} | left {left}"
    return "built"


def test_a_compat_buffer_too_big_for_the_host_says_so_before_it_maps_anything():
    segment = Config().get_nvl_buffer_size_hint(7168 * 2, 2)
    sizes = dict(hidden=7168, num_experts=2, max_tokens_per_rank=HINT_TOKENS, num_ranks=2, max_topk=16)
    touchable = size_hint(**sizes).touchable_bytes  # normal mode: all but the gaps between its blocks
    assert segment - 64 * 10 < touchable <= segment
    for said in ubep.LocalLaunch(world_size=2, timeout_s=120).run(too_big_for_the_host):
        assert said.startswith(f"deep_ep.Buffer: num_nvl_bytes={segment} ({HINT_TOKENS} tokens per rank)"), (
            said
        )
        assert "the host's available memory (MemAvailable + SwapFree) is 1048576 bytes" in said
        assert said.endswith(f"| needed {2 * touchable} | left []")

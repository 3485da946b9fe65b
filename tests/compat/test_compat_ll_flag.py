"""The compat `deep_ep.Buffer`'s low-latency size hint follows the environment as ubep.Buffer does.

With UBEP_LL_FLAG=in-word (`ubep.settings`) the low-latency slots hold every 4 bytes as an 8-byte
word, twice the bytes: the hint, a staticmethod called before any Buffer exists as in DeepEP, must
say so, and the Buffer's own check (the hint against num_rdma_bytes) must refuse the smaller size.
The hint is checked against `ubep.sizing.size_hint` and, under Triton's interpreter (the in-word
halves are Triton kernels), against the memory a Buffer built from it actually maps.
"""

from __future__ import annotations

import pytest
import torch
from interpreted import interpreted, run_interpreted

from ubep import reference
from ubep.compat.deep_ep import Buffer
from ubep.sizing import size_hint

H, E, T, K = 128, 4, 4, 2


def sized(num_ranks: int, **options) -> int:
    """One rank's segment for a low-latency ubep.Buffer of the compat layer's shapes."""
    return size_hint(
        hidden=H, num_experts=E, max_tokens_per_rank=T, num_ranks=num_ranks, max_topk=11, low_latency=True,
        **options,
    ).segment_bytes  # fmt: skip


@pytest.fixture
def environ(monkeypatch):
    for variable in ("UBEP_LL_FLAG", "UBEP_PROTOCOL", "UBEP_ENGINE", "UBEP_TRANSPORT", "UBEP_CAPTURABLE"):
        monkeypatch.delenv(variable, raising=False)
    return monkeypatch


def test_hint_follows_the_environment(environ):
    plain = Buffer.get_low_latency_rdma_size_hint(T, H, 2, E)
    assert plain == sized(2)
    environ.setenv("UBEP_LL_FLAG", "in-word")
    assert Buffer.get_low_latency_rdma_size_hint(T, H, 2, E) == sized(2, ll_flag="in-word") > plain
    environ.setenv("UBEP_PROTOCOL", "bsp")  # the normal-mode blocks share the segment
    assert Buffer.get_low_latency_rdma_size_hint(T, H, 2, E) == sized(2, ll_flag="in-word", protocol="bsp")
    environ.setenv("UBEP_LL_FLAG", "word")
    with pytest.raises(ValueError, match="UBEP_LL_FLAG='word'"):
        Buffer.get_low_latency_rdma_size_hint(T, H, 2, E)


def test_check_refuses_a_size_for_the_other_row_form(environ):
    environ.setenv("UBEP_LL_FLAG", "in-word")
    buffer = Buffer(None, num_rdma_bytes=sized(1), low_latency_mode=True)
    with pytest.raises(
        ValueError, match=rf"num_rdma_bytes={sized(1)} is too small.* gives {sized(1, ll_flag='in-word')}"
    ):
        buffer.low_latency_dispatch(
            torch.zeros(1, H, dtype=torch.bfloat16), torch.zeros(1, K, dtype=torch.int64), T, E
        )


@pytest.mark.timeout(300)
def test_interpreter_suite():
    """The interpreted test below, in a fresh interpreter with TRITON_INTERPRET=1."""
    run_interpreted(__file__, 280, "-k", "maps")


def inputs(R: int):
    gen = torch.Generator().manual_seed(11)
    xs = [torch.randn(T, H, generator=gen).bfloat16() for _ in range(R)]
    idxs = [torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]) for _ in range(R)]
    idxs[0][1, 0] = -1
    return xs, idxs


def maps_the_hint(rank) -> int:
    """Build from the hint, dispatch once against the reference; the bytes this rank's heap maps."""
    R, me = rank.world_size, rank.rank
    xs, idxs = inputs(R)
    hint = Buffer.get_low_latency_rdma_size_hint(T, H, R, E)
    with pytest.raises(ValueError, match="is too small"):
        Buffer(rank, num_rdma_bytes=hint - 1, low_latency_mode=True).low_latency_dispatch(
            xs[me], idxs[me], T, E
        )
    buffer = Buffer(rank, num_rdma_bytes=hint, low_latency_mode=True)
    recv_x, recv_count, _, _, _ = buffer.low_latency_dispatch(xs[me], idxs[me], T, E, use_fp8=False)
    ref = reference.low_latency_dispatch(xs, idxs, E, T)[me]
    valid = ref.src_token_LM >= 0
    assert torch.equal(recv_count, ref.recv_count_L.to(recv_count.dtype))
    assert torch.equal(recv_x[valid], ref.recv_x_LMX[valid])
    inner = buffer._buffers[("ll", H, E, T)]
    assert inner.ll_flag == "in-word"
    mapped = inner._ll.t._memory.arena(me).numel()  # the heap's memory, as allocated
    buffer.destroy()
    return mapped - hint


@interpreted
def test_in_word_buffer_maps_the_hint(environ):
    from ubep.transport.virtual import VirtualWorld

    environ.setenv("UBEP_LL_FLAG", "in-word")
    environ.setenv("UBEP_ENGINE", "triton")
    assert VirtualWorld(2, timeout_s=200).run(maps_the_hint) == [0, 0]

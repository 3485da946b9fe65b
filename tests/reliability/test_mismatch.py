"""Ranks that disagree on a call's payload get an error naming the culprit on every heap
protocol, never silently wrong data (issue 14, item 1(b): bsp on shared memory used to
return wrong rows when ranks disagreed on dtype or top-k, or mixed handles of two dispatches)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ubep

H, E, T = 64, 8, 6


def _inputs(me: int, K: int, dtype: torch.dtype, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed * 10 + me)
    x = torch.randn(T, H, generator=gen).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    return {"x": x, "topk_idx": idx, "topk_weights": torch.rand(T, K, generator=gen)}


def disagreeing(protocol: str, what: str) -> str:
    """Rank 1 departs from rank 0 in `what`; returns the error this rank saw."""
    me = dist.get_rank()
    odd = me == 1
    with ubep.Buffer(hidden=H, num_experts=E, max_tokens_per_rank=T, protocol=protocol, timeout_s=10) as buf:
        try:
            if what == "dtype":
                buf.dispatch(**_inputs(me, 2, torch.float32 if odd else torch.bfloat16, 0))
            elif what == "topk":
                buf.dispatch(**_inputs(me, 3 if odd else 2, torch.bfloat16, 0))
            else:  # combine with the handles of two different dispatches
                first = buf.dispatch(**_inputs(me, 2, torch.bfloat16, 0))
                second = buf.dispatch(**_inputs(me, 2, torch.bfloat16, 1))
                handle = second.handle if odd else first.handle
                recv = second.recv_x if odd else first.recv_x
                buf.combine(recv, handle)
        except (ubep.PeerDataError, ubep.PeerAbortedError) as error:
            return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["dtype", "topk", "handles"])
@pytest.mark.parametrize("protocol", ["ubep", "bsp"])
def test_disagreeing_ranks_raise_on_every_rank(protocol, what):
    seen = ubep.LocalLaunch(world_size=2, timeout_s=90).run(disagreeing, protocol, what)
    assert all(s.startswith(("PeerDataError", "PeerAbortedError")) for s in seen), seen
    assert any(s.startswith("PeerDataError") for s in seen), seen

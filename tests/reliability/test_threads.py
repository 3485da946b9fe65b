"""Two threads calling one Buffer at once: the second call is refused, naming the overlap, before it
touches anything (issue 23, item 4); the Buffer then works for the next call."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import ubep
from ubep.faults import FaultPlan


def _inputs():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, generator=gen)
    idx = torch.tensor([[0, 1], [1, 2], [3, -1], [2, 0]])
    return x, idx, torch.rand(4, 2, generator=gen)


@pytest.mark.parametrize("second", ["dispatch", "combine", "low_latency_dispatch"])
def test_a_second_thread_is_refused_while_a_call_runs(second: str) -> None:
    x, idx, w = _inputs()
    slow = FaultPlan(rank=0, point="dispatch.start", action="delay", call=2, delay_s=1.0)
    with ubep.Buffer(hidden=32, num_experts=4, max_tokens_per_rank=4, faults=slow, low_latency=True) as buf:
        first = buf.dispatch(x, topk_idx=idx, topk_weights=w)  # call 1
        inside = threading.Thread(
            target=lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w)
        )  # call 2: slow
        inside.start()
        time.sleep(0.3)
        calls = {
            "dispatch": lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w),
            "combine": lambda: buf.combine(first.recv_x, first.handle),
            "low_latency_dispatch": lambda: buf.low_latency_dispatch(x, idx, 4, 4),
        }
        with pytest.raises(RuntimeError, match="another thread is inside a call of this Buffer"):
            calls[second]()
        inside.join()
        again = buf.dispatch(x, topk_idx=idx, topk_weights=w)
        assert torch.equal(again.recv_x, first.recv_x)

"""100 back-to-back dispatch/combine calls through one Buffer, no barrier in between,
with token counts changing every call; every call checked against the reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from scenarios import Scenario, expert_output

import ubep
from ubep import reference

CALLS = 100


def consecutive_calls(protocol: str, transport: str) -> int:
    me, R = dist.get_rank(), dist.get_world_size()
    checked = 0
    with ubep.Buffer(
        hidden=32,
        num_experts=4 * R,
        max_tokens_per_rank=16,
        protocol=protocol,
        transport=transport,
        timeout_s=20,
    ) as buf:
        for call in range(CALLS):
            kind = ("uniform", "hot", "zipf")[call % 3]
            sc = Scenario(
                name=f"call-{call}",
                num_ranks=R,
                num_experts=4 * R,
                hidden=32,
                capacity=16,
                kind=kind,
                skew=0.7,
                drop=0.1 * (call % 2),
                seed=1000 + call,
            )
            xs, idxs, ws, ref = sc.expected()
            got = buf.dispatch(xs[me], topk_idx=idxs[me], topk_weights=ws[me])
            assert torch.equal(got.recv_x, ref[me].recv_x_MH), f"call {call}"
            assert torch.equal(got.recv_topk_idx, ref[me].recv_topk_idx_MK), f"call {call}"
            ys = [expert_output(ref[r].recv_x_MH, r) for r in range(R)]
            want = reference.combine(ys, ref, [x.shape[0] for x in xs])[me]
            out = buf.combine(expert_output(got.recv_x, me), got.handle)
            assert torch.equal(out.combined_x, want), f"call {call}"
            checked += 1
    return checked


@pytest.mark.parametrize("protocol,transport", [("ubep", "shm"), ("bsp", "shm"), ("bsp", "dist")])
def test_hundred_calls_without_barrier(protocol, transport):
    assert (
        ubep.LocalLaunch(world_size=4, timeout_s=240).run(consecutive_calls, protocol, transport)
        == [CALLS] * 4
    )

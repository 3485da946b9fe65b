"""Every protocol x transport against the reference, at world sizes 1, 2, 4 and 8."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from scenarios import Scenario, assert_dispatch_matches, expert_output, scenarios_for

import ubep
from ubep import reference

COMBOS = [("ubep", "shm"), ("bsp", "shm"), ("bsp", "dist")]


def check_scenario(buf: ubep.Buffer, sc: Scenario, me: int) -> None:
    xs, idxs, ws, ref = sc.expected()
    mine = ref[me]
    layout = buf.get_dispatch_layout(idxs[me], sc.num_experts)
    got = buf.dispatch(
        xs[me],
        topk_idx=idxs[me],
        topk_weights=ws[me],
        num_tokens_per_rank=layout.num_tokens_per_rank,
        is_token_in_rank=layout.is_token_in_rank,
    )
    where = f"{sc.name} rank {me}"
    assert_dispatch_matches(got, mine, where)

    ys = [expert_output(ref[r].recv_x_MH, r) for r in range(sc.num_ranks)]
    want = reference.combine(ys, ref, [x.shape[0] for x in xs])[me]
    out = buf.combine(expert_output(got.recv_x, me), got.handle, topk_weights=got.recv_topk_weights)
    torch.testing.assert_close(out.combined_x, want, rtol=0, atol=0, msg=where)
    torch.testing.assert_close(out.combined_topk_weights, torch.where(idxs[me] >= 0, ws[me], 0.0), msg=where)

    again = buf.dispatch(xs[me] * 2, handle=got.handle)  # cached dispatch: same routing, new data
    assert torch.equal(again.recv_x, mine.recv_x_MH * 2), where
    assert again.recv_topk_idx is None


def run_matrix(protocol: str, transport: str, alignment: int) -> int:
    me, R = (
        dist.get_rank() if dist.is_initialized() else 0,
        dist.get_world_size() if dist.is_initialized() else 1,
    )
    checked = 0
    for sc in scenarios_for(R):
        with ubep.Buffer(
            hidden=sc.hidden,
            num_experts=sc.num_experts,
            max_tokens_per_rank=sc.capacity,
            protocol=protocol,
            transport=transport,
            timeout_s=20,
        ) as buf:
            check_scenario(buf, sc, me)
            checked += 1
    return checked


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("protocol,transport", COMBOS)
def test_matches_reference(world_size, protocol, transport):
    counts = ubep.LocalLaunch(world_size=world_size, timeout_s=240).run(run_matrix, protocol, transport, 1)
    assert counts == [len(scenarios_for(world_size))] * world_size


def test_one_rank_is_the_reference():
    assert run_matrix("ubep", "auto", 1) == len(scenarios_for(1))


def alignment_case(alignment: int) -> list[int]:
    me = dist.get_rank()
    sc = Scenario(name="align", num_ranks=dist.get_world_size(), num_experts=8, seed=11)
    xs, idxs, ws, ref = sc.expected()
    with ubep.Buffer(hidden=sc.hidden, num_experts=8, max_tokens_per_rank=sc.capacity) as buf:
        got = buf.dispatch(xs[me], topk_idx=idxs[me], topk_weights=ws[me], expert_alignment=alignment)
    raw = ref[me].num_recv_tokens_per_expert
    assert got.num_recv_tokens_per_expert_list == [(c + alignment - 1) // alignment * alignment for c in raw]
    return got.num_recv_tokens_per_expert_list


def test_expert_alignment_rounds_up():
    lists = ubep.LocalLaunch(world_size=2, timeout_s=60).run(alignment_case, 16)
    assert all(c % 16 == 0 for counts in lists for c in counts)


def scheduled_workers(workers: int, policy: str) -> int:
    """Combine with several put workers following the token scheduler, checked every call."""
    me, R = dist.get_rank(), dist.get_world_size()
    checked = 0
    with ubep.Buffer(
        hidden=64, num_experts=4 * R, max_tokens_per_rank=24, workers=workers, schedule=policy, timeout_s=20
    ) as buf:
        for seed in range(4):
            sc = Scenario(
                name=f"workers-{workers}-{policy}-{seed}",
                num_ranks=R,
                num_experts=4 * R,
                kind="hot",
                skew=0.7,
                drop=0.1,
                seed=40 + seed,
            )
            xs, idxs, ws, ref = sc.expected()
            got = buf.dispatch(xs[me], topk_idx=idxs[me], topk_weights=ws[me])
            ys = [expert_output(ref[r].recv_x_MH, r) for r in range(R)]
            want = reference.combine(ys, ref, [x.shape[0] for x in xs])[me]
            out = buf.combine(expert_output(got.recv_x, me), got.handle, topk_weights=got.recv_topk_weights)
            assert torch.equal(out.combined_x, want), sc.name
            assert torch.equal(out.combined_topk_weights, torch.where(idxs[me] >= 0, ws[me], 0.0)), sc.name
            checked += 1
    return checked


@pytest.mark.parametrize("workers,policy", [(3, "ubep"), (2, "balanced"), (2, "bsp")])
def test_scheduled_put_workers_match_reference(workers, policy):
    assert ubep.LocalLaunch(world_size=4, timeout_s=120).run(scheduled_workers, workers, policy) == [4] * 4

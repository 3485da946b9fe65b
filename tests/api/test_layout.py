"""Layout and placement: pure functions, checked against the reference and by hand."""

from __future__ import annotations

import torch
import torch.distributed as dist
from scenarios import Scenario

import ubep
from ubep import reference
from ubep.layout import ExpertPlacement, dispatch_layout, localize_topk, prefix_offsets, tokens_per_node


def test_layout_matches_reference_counts():
    sc = Scenario(name="layout", num_ranks=4, num_experts=16, drop=0.2, nowhere=2, tokens=(20, 0, 7, 24))
    _, idxs, _, ref = sc.expected()
    placement = ExpertPlacement.contiguous(16, 4)
    for src in range(4):
        layout = dispatch_layout(idxs[src], placement)
        for dst in range(4):
            from_src = ref[dst].src_rank_M == src
            assert int(layout.num_tokens_per_rank_R[dst]) == int(from_src.sum())
            assert torch.equal(
                torch.nonzero(layout.is_token_in_rank_NR[:, dst]).flatten(), ref[dst].src_token_M[from_src]
            )
        expected = torch.bincount(idxs[src][idxs[src] >= 0], minlength=16)
        assert torch.equal(layout.num_tokens_per_expert_E, expected.to(torch.int32))


def test_small_case_by_hand():
    # 4 experts on 2 ranks: rank 0 owns experts 0,1; rank 1 owns 2,3.
    idx = torch.tensor([[0, 3], [1, -1], [-1, -1], [2, 3]])
    layout = dispatch_layout(idx, ExpertPlacement.contiguous(4, 2))
    assert layout.is_token_in_rank_NR.tolist() == [[True, True], [True, False], [False, False], [False, True]]
    assert layout.num_tokens_per_rank_R.tolist() == [2, 2]
    assert layout.num_tokens_per_expert_E.tolist() == [1, 1, 1, 2]
    local, w = localize_topk(idx, torch.ones(4, 2), ExpertPlacement.contiguous(4, 2), rank=1)
    assert local.tolist() == [[-1, 1], [-1, -1], [-1, -1], [0, 1]]
    assert w.tolist() == [[0, 1], [0, 0], [0, 0], [1, 1]]
    assert prefix_offsets(torch.tensor([2, 0, 3])).tolist() == [0, 2, 2, 5]


def test_explicit_placement_local_ids():
    placement = ExpertPlacement.from_ranks([1, 0, 1, 0], num_ranks=2)
    assert placement.local_index_E.tolist() == [0, 0, 1, 1]
    try:
        ExpertPlacement.from_ranks([0, 0, 0, 1], num_ranks=2)
    except ValueError as e:
        assert "every rank must own 2 experts" in str(e)
    else:
        raise AssertionError("an unbalanced placement must be rejected")


def explicit_placement_run(owners: list[int]) -> bool:
    me, R = dist.get_rank(), dist.get_world_size()
    sc = Scenario(name="placement", num_ranks=R, num_experts=len(owners), seed=21)
    xs, idxs, ws = sc.inputs()
    ref = reference.dispatch(xs, idxs, ws, len(owners), rank_of_expert=owners)
    with ubep.Buffer(
        hidden=sc.hidden, num_experts=len(owners), max_tokens_per_rank=sc.capacity, expert_placement=owners
    ) as buf:
        got = buf.dispatch(xs[me], topk_idx=idxs[me], topk_weights=ws[me])
    return torch.equal(got.recv_x, ref[me].recv_x_MH) and torch.equal(
        got.recv_topk_idx, ref[me].recv_topk_idx_MK
    )


def test_explicit_placement_end_to_end():
    owners = [1, 0, 1, 0, 0, 1, 0, 1]  # interleaved, not contiguous
    assert ubep.LocalLaunch(world_size=2, timeout_s=60).run(explicit_placement_run, owners) == [True, True]


def test_tokens_per_node_counts_each_token_once_per_node():
    gen = torch.Generator().manual_seed(5)
    in_rank_NR = torch.rand(40, 6, generator=gen) < 0.3
    node_of_rank = (0, 0, 1, 1, 2, 2)
    want = [sum(bool(in_rank_NR[n, 2 * g : 2 * g + 2].any()) for n in range(40)) for g in range(3)]
    assert tokens_per_node(in_rank_NR, node_of_rank).tolist() == want

"""The hierarchical exchange on emulated nodes (LOCAL_WORLD_SIZE < WORLD_SIZE on one host):
every scenario against the reference, cached dispatch, back-to-back calls, the
boundary-byte accounting against what really crossed, and failure on bad input.
Node geometry, the accounting and the transport choice are checked without processes."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from scenarios import Scenario, assert_dispatch_matches, expert_output, scenarios_for

import ubep
from ubep import reference
from ubep.across.collectives.bsp_hier import as_bytes, boundary_bytes, columns, dispatch_row_bytes
from ubep.group import GroupInfo, choose_transport
from ubep.layout import ExpertPlacement
from ubep.nodes import NodeMap, tokens_per_slot

# -- without processes ------------------------------------------------------------------------------


def test_rails_pair_the_same_local_index_across_nodes():
    nodes = NodeMap((0, 0, 1, 1, 2, 2))
    assert (nodes.num_nodes, nodes.ranks_per_node) == (3, 2)
    assert nodes.rail(1) == (1, 3, 5)
    assert nodes.local_index(4) == 0
    assert nodes.slot_ranks(1).tolist() == [[0, 1], [2, 3], [4, 5]]
    interleaved = NodeMap((0, 1, 1, 0))  # node 0 holds ranks 0, 3; node 1 ranks 1, 2
    assert interleaved.rail(1) == (2, 3)  # rank 2 (node 1) comes first in group rank order
    assert interleaved.slot_ranks(1).tolist() == [[1, 2], [0, 3]]
    assert not NodeMap((0, 0, 1)).uniform()[0]


def test_tokens_cross_to_a_node_once():
    is_token_in_rank_NR = torch.tensor([[False, True, False, True], [False, False, True, True]])
    slots = torch.tensor([[0, 1], [2, 3]])
    assert tokens_per_slot(is_token_in_rank_NR, slots).tolist() == [[True, True], [False, True]]


def test_boundary_bytes_by_hand():
    placement = ExpertPlacement.contiguous(4, 4)  # one expert per rank
    idx = [torch.tensor([[0, 2, 3], [1, -1, -1]]), torch.empty(0, 3, dtype=torch.int64)]
    idx += [torch.tensor([[0, 1, 2]]), torch.tensor([[3, -1, -1]])]
    got = boundary_bytes(idx, placement, (0, 0, 1, 1), hidden=8, dtype=torch.bfloat16)
    assert got["dispatch_rows_flat"] == [2, 0, 2, 0]  # rank 2's token goes to ranks 0 and 1
    assert got["dispatch_rows_dedup"] == [1, 0, 1, 0]
    assert got["dispatch_bytes_dedup"][0] == dispatch_row_bytes(8, 2, 3) == 16 + 8 + 36
    assert got["combine_bytes_flat"] == [32, 0, 32, 0]  # two bf16 rows of 8
    assert got["combine_bytes_dedup"] == [32, 0, 32, 0]  # one float32 partial of 8


def test_columns_of_a_single_packed_row_with_odd_topk():
    """One row of 8 + 3 * 8 + 3 * 4 = 44 bytes: each column block still views as its dtype."""
    token, idx, w = torch.tensor([[5]]), torch.tensor([[1, 2, 3]]), torch.tensor([[0.5, 0.25, 0.125]])
    rows_SB = torch.cat([as_bytes(token), as_bytes(idx), as_bytes(w)], dim=1)
    got = columns(rows_SB, [(torch.int64, 1), (torch.int64, 3), (torch.float32, 3)])
    assert [torch.equal(a, b) for a, b in zip(got, (token, idx, w), strict=True)] == [True] * 3


def test_auto_spans_nodes_with_hier_and_dist_stays_flat():
    two_nodes = GroupInfo(None, 0, 4, (0, 0, 1, 1))
    assert choose_transport("auto", two_nodes)[0] == "hier"
    assert choose_transport("dist", two_nodes)[0] == "dist"
    uneven = GroupInfo(None, 0, 3, (0, 0, 1))
    name, why = choose_transport("auto", uneven)
    assert name == "dist" and "different numbers of ranks" in why
    with pytest.raises(ValueError, match="hier"):
        choose_transport("hier", uneven)


def test_auto_takes_the_flat_path_with_one_rank_per_host():
    """Dedup needs two ranks of a host behind one crossing: with one rank per host, hier only adds its
    float32 partials, so auto goes flat, and says why; asked for, hier still runs."""
    one_each = GroupInfo(None, 0, 3, (0, 1, 2))
    name, why = choose_transport("auto", one_each)
    assert name == "dist" and "one rank on each of 3 hosts" in why
    assert choose_transport("hier", GroupInfo(None, 0, 2, (0, 1)))[0] == "hier"


# -- on emulated nodes ------------------------------------------------------------------------------


def check_combine(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    """Exact for 16-bit outputs; float32 sums are grouped by node, so allow float32 rounding."""
    tol = {"rtol": 0, "atol": 0} if want.dtype != torch.float32 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(got, want, msg=where, **tol)


def check_hier(buf: ubep.Buffer, sc: Scenario, me: int) -> None:
    xs, idxs, ws, ref = sc.expected()
    mine, where = ref[me], f"{sc.name} rank {me}"
    got = buf.dispatch(xs[me], topk_idx=idxs[me], topk_weights=ws[me])
    assert_dispatch_matches(got, mine, where)

    ys = [expert_output(ref[r].recv_x_MH, r) for r in range(sc.num_ranks)]
    want = reference.combine(ys, ref, [x.shape[0] for x in xs])[me]
    out = buf.combine(expert_output(got.recv_x, me), got.handle, topk_weights=got.recv_topk_weights)
    check_combine(out.combined_x, want, where)
    assert torch.equal(out.combined_topk_weights, torch.where(idxs[me] >= 0, ws[me], 0.0)), where

    again = buf.dispatch(xs[me] * 2, handle=got.handle)  # cached: same routing, new data
    assert torch.equal(again.recv_x, mine.recv_x_MH * 2), where
    assert again.recv_topk_idx is None
    out2 = buf.combine(expert_output(again.recv_x, me), got.handle)
    ys2 = [expert_output(ref[r].recv_x_MH * 2, r) for r in range(sc.num_ranks)]
    check_combine(out2.combined_x, reference.combine(ys2, ref, [x.shape[0] for x in xs])[me], where)
    check_accounting(buf, got.handle, idxs, me, where)


def check_accounting(buf: ubep.Buffer, handle: ubep.DispatchHandle, idxs, me: int, where: str) -> None:
    """boundary_bytes agrees with the rows this rank really sent across, flat and deduplicated."""
    node_R = torch.tensor(buf._info.node_of_rank)
    counted = boundary_bytes(
        idxs, buf.sizing.placement, buf._info.node_of_rank, buf.sizing.hidden, torch.bfloat16
    )
    assert int(handle.route.send_counts_G.sum()) == counted["dispatch_rows_dedup"][me], where
    remote = node_R != node_R[me]
    assert int(handle.send_counts_R[remote].sum()) == counted["dispatch_rows_flat"][me], where


def back_to_back(buf: ubep.Buffer, R: int, me: int, calls: int) -> None:
    """Calls with changing routing through one Buffer: both buffer halves are reused, no barrier."""
    for call in range(calls):
        sc = Scenario(
            name=f"call-{call}",
            num_ranks=R,
            num_experts=4 * R,
            capacity=16,
            kind=("uniform", "hot")[call % 2],
            skew=0.7,
            drop=0.1 * (call % 3),
            seed=500 + call,
        )
        xs, idxs, ws, ref = sc.expected()
        got = buf.dispatch(xs[me], topk_idx=idxs[me], topk_weights=ws[me])
        assert torch.equal(got.recv_x, ref[me].recv_x_MH), sc.name
        ys = [expert_output(ref[r].recv_x_MH, r) for r in range(R)]
        want = reference.combine(ys, ref, [x.shape[0] for x in xs])[me]
        assert torch.equal(buf.combine(expert_output(got.recv_x, me), got.handle).combined_x, want), sc.name


def run_hier(calls: int) -> int:
    me, R = dist.get_rank(), dist.get_world_size()
    checked = 0
    for sc in scenarios_for(R):
        with ubep.Buffer(
            hidden=sc.hidden,
            num_experts=sc.num_experts,
            max_tokens_per_rank=sc.capacity,
            timeout_s=20,
            transport="hier",  # asked for: with one rank per node, "auto" takes the flat path
        ) as buf:
            assert buf.transport == "hier", buf.explain()
            check_hier(buf, sc, me)
            checked += 1
    with ubep.Buffer(
        hidden=64, num_experts=4 * R, max_tokens_per_rank=24, timeout_s=20, transport="hier"
    ) as buf:
        back_to_back(buf, R, me, calls)
    return checked


@pytest.mark.parametrize("world_size,per_node", [(4, 2), (4, 1), (8, 4), (8, 2)])
def test_hier_matches_reference(world_size, per_node):
    launch = ubep.LocalLaunch(world_size=world_size, ranks_per_node=per_node, timeout_s=240)
    assert launch.run(run_hier, 12) == [len(scenarios_for(world_size))] * world_size


def reject_on_rank_one(stay_s: float) -> str:
    """Rank 1 rejects its routing and stays alive (its rail peer learns from the fabric's abort notice)."""
    me = dist.get_rank()
    sc = Scenario(name="reject", num_ranks=4, num_experts=8, seed=9)
    xs, idxs, ws = sc.inputs()
    with ubep.Buffer(hidden=sc.hidden, num_experts=8, max_tokens_per_rank=sc.capacity, timeout_s=2) as buf:
        idx = idxs[me] if me != 1 else torch.full_like(idxs[me], 99)
        try:
            buf.dispatch(xs[me], topk_idx=idx, topk_weights=ws[me])
        except Exception as err:
            time.sleep(stay_s if me == 1 else 0)
            return f"{type(err).__name__}: {err}"
    return "no error"


def test_bad_input_on_one_rank_fails_every_rank_within_the_timeout():
    errors = ubep.LocalLaunch(world_size=4, ranks_per_node=2, timeout_s=60).run(reject_on_rank_one, 3.0)
    assert errors[1].startswith("ValueError: topk_idx"), errors
    assert errors[0].startswith("PeerAbortedError"), errors  # rank 1's node peer learns at once
    told = "PeerAbortedError: dispatch (across nodes): rank 1 aborted the call (it rejected"
    assert errors[3].startswith(told), errors  # its rail peer, by the fabric's notice
    assert errors[2].startswith("PeerAbortedError"), errors  # told by rank 3, its node peer

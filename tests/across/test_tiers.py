"""Three tiers of distance (issue 44 item 4): transport "tiers" over racks of hosts of ranks, against
the plain-torch reference.

- Racks.of places a rank in its rack and names its two rails (pure logic, by hand).
- Dispatch, combine (with weights) and cached dispatch match the reference on 2 racks of 2 hosts of
  2 ranks and on an uneven shape (2 racks of 3 hosts of 1 rank), over the fabric between emulated
  hosts (`LocalLaunch(ranks_per_node=...)`, loopback TCP), and `explain()` says the three tiers.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from scenarios import Scenario, assert_dispatch_matches, expert_output, scenarios_for

import ubep
from ubep import reference
from ubep.across.ubep_tiers import Racks


def test_racks_place_a_rank_and_name_its_rails():
    node_of_rank = (0, 0, 1, 1, 2, 2, 3, 3)  # 4 hosts of 2 ranks; 2 racks: hosts {0, 1}, {2, 3}
    five = Racks.of(node_of_rank, 5, 2)  # host 2 (rack 1, its first host), local index 1
    assert (five.rack, five.host_slot) == (1, 0)
    assert five.rack_rail == (1, 5)  # rack 0's first host's local 1, and itself
    assert five.host_rail == (5, 7)  # local 1 on each host of rack 1
    assert five.rack_ranks_QW.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert five.host_ranks_JP.tolist() == [[4, 5], [6, 7]]
    with pytest.raises(ValueError, match="racks must be at least 2 and divide the 4 hosts"):
        Racks.of(node_of_rank, 0, 3)


def tier_round(buf: ubep.Buffer, sc: Scenario, me: int) -> None:
    """Dispatch, combine (with weights), cached dispatch and combine, each against the reference."""
    xs, idxs, ws, ref = sc.expected()
    where = f"{sc.name} rank {me}"
    got = buf.dispatch(xs[me], topk_idx=idxs[me], topk_weights=ws[me])
    assert_dispatch_matches(got, ref[me], where)
    ys = [expert_output(ref[r].recv_x_MH, r) for r in range(sc.num_ranks)]
    want = reference.combine(ys, ref, [x.shape[0] for x in xs])[me]
    out = buf.combine(expert_output(got.recv_x, me), got.handle, topk_weights=got.recv_topk_weights)
    tol = {"rtol": 0, "atol": 0} if want.dtype != torch.float32 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(out.combined_x, want, **tol, msg=where)  # float32: summed by rack, host
    assert torch.equal(out.combined_topk_weights, torch.where(idxs[me] >= 0, ws[me], 0.0)), where
    again = buf.dispatch(xs[me] * 2, handle=got.handle)
    assert torch.equal(again.recv_x, ref[me].recv_x_MH * 2), where
    back = buf.combine(expert_output(again.recv_x, me), again.handle)
    ys2 = [expert_output(ref[r].recv_x_MH * 2, r) for r in range(sc.num_ranks)]
    want2 = reference.combine(ys2, ref, [x.shape[0] for x in xs])[me]
    torch.testing.assert_close(back.combined_x, want2, **tol, msg=where)


def tiers_match_the_reference(racks: int) -> list[str]:
    me, R = dist.get_rank(), dist.get_world_size()
    picked = [sc for sc in scenarios_for(R) if sc.name != "hot-experts"]
    sc0 = picked[0]
    with ubep.Buffer(
        hidden=sc0.hidden, num_experts=sc0.num_experts, max_tokens_per_rank=sc0.capacity, max_topk=8,
        transport="tiers", racks=racks, timeout_s=60,
    ) as buf:  # fmt: skip
        said = buf.explain()
        for sc in picked:
            if sc.num_experts == sc0.num_experts:
                tier_round(buf, sc, me)
    with ubep.Buffer(
        hidden=64, num_experts=R, max_tokens_per_rank=24, transport="tiers", racks=racks, timeout_s=60
    ) as buf:
        tier_round(buf, picked[1], me)
    return [line for line in said.splitlines() if "three tiers" in line]


@pytest.mark.timeout(500)
@pytest.mark.parametrize(
    ("world_size", "per_node", "racks"),
    [(8, 2, 2), (6, 1, 2)],
    ids=["2x2x2", "2-racks-of-3-hosts-of-1"],
)
def test_tiers_match_the_reference(world_size, per_node, racks):
    launch = ubep.LocalLaunch(world_size=world_size, ranks_per_node=per_node, timeout_s=480)
    said = launch.run(tiers_match_the_reference, racks)
    assert all(len(lines) == 1 and "no collective inside a call" in lines[0] for lines in said), said

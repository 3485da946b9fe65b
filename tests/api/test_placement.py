"""Expert placement (`ubep.placement`): the placements' properties, the nearest-copy map against
a plain-Python reading of its rule, and dispatch + combine with redundant experts against the
reference on the logical routing, on shared memory and on emulated nodes."""

from __future__ import annotations

import pytest
import torch
from scenarios import Scenario

import ubep
from ubep import reference, routing
from ubep.placement import CopyMap, Distances, Placement, balance, eplb, measure
from ubep.placement.baseline import balanced_packing, replicate
from ubep.topology import cm384
from ubep.transport.virtual import VirtualWorld

# -- placements, without processes -----------------------------------------------------------------


def zipf_routing(ranks: int, tokens: int, experts: int, topk: int, seed: int, shared: bool):
    """Every rank's zipf(1.2) routing: one popularity for all (`shared`) or one per rank."""
    gen = torch.Generator().manual_seed(seed)
    if shared:
        return list(routing.zipf(ranks * tokens, experts, topk, 1.2, gen).reshape(ranks, tokens, topk))
    return [routing.zipf(tokens, experts, topk, 1.2, gen) for _ in range(ranks)]


def loads(topk_idxs: list[torch.Tensor], experts: int) -> torch.Tensor:
    """[R, E]: pairs per source rank and expert."""
    return torch.stack([torch.bincount(i[i >= 0], minlength=experts) for i in topk_idxs])


def check_layout(p: Placement, experts: int, ranks: int, slots: int) -> None:
    assert (p.num_logical, p.num_ranks, p.num_physical) == (experts, ranks, ranks * slots)
    assert int(p.copies_E.min()) >= 1  # every expert somewhere
    assert int(p.copies_E.sum()) == ranks * slots  # every slot holds an expert


@pytest.mark.parametrize("shared", [False, True])
def test_placements_fill_every_slot_and_keep_every_expert(shared):
    R, E, L = 8, 64, 10
    idxs = zipf_routing(R, 64, E, 4, seed=3, shared=shared)
    d = Distances.from_nodes([r // 4 for r in range(R)])
    ours = balance(loads(idxs, E), d, L)
    check_layout(ours, E, R, L)
    for r in range(R):  # ubep never puts two copies of one expert on one rank
        assert ours.local_logical(r).unique().numel() == L
    check_layout(eplb(loads(idxs, E), R, L, num_nodes=2, num_groups=8), E, R, L)
    check_layout(eplb(loads(idxs, E), R, L, num_nodes=2), E, R, L)


@pytest.mark.parametrize("shared", [False, True])
def test_zipf_rank_load_within_the_bound_and_below_no_placement(shared):
    """8 ranks, 2 nodes, zipf 1.2 (the issue's setting, smaller): max / mean <= 1.15."""
    R, E, K = 8, 128, 8
    idxs = zipf_routing(R, 128, E, K, seed=1, shared=shared)
    d = Distances.from_nodes([r // 4 for r in range(R)])
    ours = measure(balance(loads(idxs, E), d, (E + 16) // R), idxs, d, hidden=64)
    none = measure(Placement.identity(E, R), idxs, d, hidden=64)
    assert ours.imbalance <= 1.15, ours
    assert none.imbalance > 1.15  # the skew is real: without placement the busiest rank lags


def test_fewer_pairs_cross_nodes_than_the_load_only_baseline():
    """Where sources differ in what they route (per-rank zipf), ubep keeps pairs in their node."""
    R, E, K = 8, 128, 8
    idxs = zipf_routing(R, 128, E, K, seed=2, shared=False)
    d = Distances.from_nodes([r // 4 for r in range(R)])
    load, L = loads(idxs, E), (E + 16) // R
    ours = measure(balance(load, d, L), idxs, d, hidden=64)
    base = measure(eplb(load, R, L, num_nodes=2, num_groups=8), idxs, d, hidden=64, nearest=False)
    assert ours.cross_node_pairs <= 0.8 * base.cross_node_pairs, (ours, base)
    assert ours.cross_node_bytes_flat <= 0.8 * base.cross_node_bytes_flat, (ours, base)
    assert ours.imbalance <= 1.15


def test_an_expert_used_by_one_node_is_placed_on_it():
    """Hand example: 2 nodes of 2 ranks, 4 experts, one slot each; rank 3 alone uses expert 0."""
    load = torch.zeros(4, 4)
    load[3, 0] = 5.0
    load[0, 1] = load[1, 2] = load[2, 3] = 5.0
    p = balance(load, Distances.from_nodes([0, 0, 1, 1]), slots_per_rank=1)
    assert p.logical_of_physical_U.tolist() == [1, 2, 3, 0]  # every expert on the rank that uses it


def test_a_hot_expert_of_one_popularity_gets_a_copy_in_every_node():
    """Every source routes expert 0 heavily: the redundant slots put a copy of it in each node."""
    R, E = 4, 4
    load = torch.ones(R, E)
    load[:, 0] = 6.0  # expert 0 alone is more than a rank's share
    p = balance(load, Distances.from_nodes([0, 0, 1, 1]), slots_per_rank=2)
    ranks = p.rank_of_physical_U[p.logical_of_physical_U == 0]
    assert {int(r) // 2 for r in ranks} == {0, 1}


def test_placement_on_a_topology_keeps_pairs_inside_cm384_nodes():
    R, E = 32, 64
    idxs = zipf_routing(R, 32, E, 4, seed=4, shared=True)
    d = Distances.from_topology(cm384(), R)
    assert d.node_of_rank().tolist() == [r // 8 * 8 for r in range(R)]
    load, L = loads(idxs, E), (E + R) // R
    ours = measure(balance(load, d, L), idxs, d, hidden=64)
    base = measure(eplb(load, R, L, num_nodes=4, num_groups=8), idxs, d, hidden=64, nearest=False)
    assert ours.cross_node_pairs < base.cross_node_pairs
    assert ours.imbalance <= 1.15


def test_eplb_steps_by_hand():
    assert balanced_packing(torch.tensor([5.0, 1.0, 4.0, 2.0]).numpy(), 2).tolist() == [0, 0, 1, 1]
    assert replicate(torch.tensor([6.0, 1.0, 2.0]).numpy(), 5).tolist() == [0, 1, 2, 0, 0]
    # two nodes of one rank, two slots each; groups [0, 1] and [2, 3], the second the heavier
    p = eplb(torch.tensor([1.0, 1.0, 8.0, 2.0]), num_ranks=2, slots_per_rank=3, num_nodes=2, num_groups=2)
    assert p.logical_of_physical_U.tolist() == [2, 3, 2, 0, 1, 0]  # each node replicates its heaviest


def test_placement_tables():
    p = Placement.from_list([0, 2, 1, 0], num_ranks=2, num_logical=3)
    assert p.physical_of_logical_EJ().tolist() == [[0, 3], [2, -1], [1, -1]]
    assert p.copies_E.tolist() == [2, 1, 1] and p.local_logical(1).tolist() == [1, 0]
    assert p.logical_load(torch.tensor([[1, 2, 3, 4], [0, 0, 0, 5]])).tolist() == [[5, 3, 2], [5, 0, 0]]
    with pytest.raises(ValueError, match="no copy"):
        Placement.from_list([0, 0, 1, 1], num_ranks=2, num_logical=3)
    with pytest.raises(ValueError, match="split"):
        Placement.from_list([0, 1, 2], num_ranks=2, num_logical=3)
    assert p.digest() != Placement.from_list([0, 2, 0, 1], 2, 3).digest()


# -- the nearest-copy map against a plain-Python reading of its rule ---------------------------------


def nearest_copies(p: Placement, rank: int, node_of_rank: list[int], expert: int) -> list[int]:
    """Plain Python: the copies on `rank`, else on its node, else all of them."""
    L = p.slots_per_rank
    copies = [u for u, e in enumerate(p.logical_of_physical_U.tolist()) if e == expert]
    for near in (
        [u for u in copies if u // L == rank],
        [u for u in copies if node_of_rank[u // L] == node_of_rank[rank]],
    ):
        if near:
            return near
    return copies


@pytest.mark.parametrize("compiled", [True, False])
def test_nearest_copy_map_against_plain_python(compiled):
    gen = torch.Generator().manual_seed(7)
    R, E, L, nodes = 6, 8, 3, [0, 0, 0, 1, 1, 1]
    for trial in range(5):
        logical = torch.cat([torch.arange(E), torch.randint(0, E, (R * L - E,), generator=gen)])
        p = Placement(R, E, logical[torch.randperm(R * L, generator=gen)])
        for rank in range(R):
            idx = routing.drop(routing.uniform(40, E, 4, gen), 0.1, gen)
            got = CopyMap.nearest(p, rank, Distances.from_nodes(nodes), compiled=compiled)(idx)
            assert torch.equal(got < 0, idx < 0)
            per_copy: dict[int, int] = {}
            for n, k in zip(*torch.nonzero(idx >= 0, as_tuple=True), strict=True):
                e, u = int(idx[n, k]), int(got[n, k])
                near = nearest_copies(p, rank, nodes, e)
                assert u in near, (trial, rank, e, u, near)
                per_copy[u] = per_copy.get(u, 0) + 1
            for e in range(E):  # balanced among equally near copies: counts differ by at most one
                counts = [per_copy.get(u, 0) for u in nearest_copies(p, rank, nodes, e)]
                assert max(counts) - min(counts) <= 1, (rank, e, counts)


def test_compiled_map_and_torch_map_agree_and_reject_bad_ids():
    p = Placement.from_list([0, 1, 2, 0, 1, 0], num_ranks=3, num_logical=3)
    gen = torch.Generator().manual_seed(1)
    idx = routing.drop(routing.uniform(64, 3, 2, gen), 0.2, gen)
    for rank in range(3):
        fast, slow = CopyMap.load_only(p, rank), CopyMap.load_only(p, rank, compiled=False)
        assert torch.equal(fast(idx), slow(idx))
    for m in (CopyMap.load_only(p, 0), CopyMap.load_only(p, 0, compiled=False)):
        with pytest.raises(ValueError, match=r"\[-1, 3\); found 3"):
            m(torch.tensor([[0, 3]]))
        with pytest.raises(ValueError, match="found -2"):
            m(torch.tensor([[-2, 1]]))


# -- Buffer.set_placement: dispatch + combine on physical copies, exact against the logical reference


R_MP, E_MP, L_MP, K_MP, H_MP = 4, 8, 3, 3, 16  # 12 slots: 4 redundant


def mp_inputs():
    """Every rank's tokens: small integers and dyadic weights, so every float32 sum is exact and the
    combine may group the terms by rank however the placement does."""
    gen = torch.Generator().manual_seed(11)
    xs, idxs, ws = [], [], []
    for n in (5, 0, 7, 6):
        idxs.append(routing.zipf(n, E_MP, K_MP, 1.2, gen))
        xs.append(torch.randint(-8, 9, (n, H_MP), generator=gen).float())
        ws.append(2.0 ** -torch.randint(1, 4, (n, K_MP), generator=gen).float())
    return xs, idxs, ws


def expert(logical_K: torch.Tensor, w_MK: torch.Tensor, x_MH: torch.Tensor) -> torch.Tensor:
    """A stand-in for the experts: row m sums w[m, k] * (logical expert + 1) * x[m] over its valid k."""
    y_MH = torch.zeros_like(x_MH)
    for k in range(logical_K.shape[1]):
        valid = logical_K[:, k] >= 0
        scale = torch.where(valid, w_MK[:, k] * (logical_K[:, k] + 1).float(), 0.0)
        y_MH += scale[:, None] * x_MH
    return y_MH


def placed_rank(per_node: int):
    me = torch.distributed.get_rank()
    xs, idxs, ws = mp_inputs()
    nodes = [r // per_node for r in range(R_MP)]
    p = balance(loads(idxs, E_MP), Distances.from_nodes(nodes), L_MP)
    ref = reference.dispatch(xs, idxs, ws, E_MP)
    ys = []
    for r, got in enumerate(ref):  # the reference's experts: logical ids, contiguous placement
        logical = torch.where(got.recv_topk_idx_MK >= 0, got.recv_topk_idx_MK + r * (E_MP // R_MP), -1)
        ys.append(expert(logical, got.recv_topk_weights_MK, got.recv_x_MH))
    want = reference.combine(ys, ref, [x.shape[0] for x in xs])[me]
    with ubep.Buffer(
        hidden=H_MP, num_experts=R_MP * L_MP, max_tokens_per_rank=8, timeout_s=30, low_latency=True
    ) as buf:
        other = Placement(R_MP, E_MP, p.logical_of_physical_U.roll(1))  # what rank 1 passes
        with pytest.raises(ubep.ConfigMismatchError, match="placement"):
            buf.set_placement(p if me != 1 else other)
        assert buf.placement is None  # nothing changed anywhere
        buf.set_placement(p)
        got = buf.dispatch(xs[me], topk_idx=idxs[me], topk_weights=ws[me])
        slots = p.local_logical(me)
        logical = torch.where(got.recv_topk_idx >= 0, slots[got.recv_topk_idx.clamp(min=0)], -1)
        y = expert(logical, got.recv_topk_weights, got.recv_x)
        combined = buf.combine(y, got.handle).combined_x
        assert torch.equal(combined, want), f"rank {me}"
        layout = buf.get_dispatch_layout(idxs[me], E_MP)
        assert torch.equal(layout.num_tokens_per_rank, got.handle.send_counts_R)
        if per_node == R_MP:
            check_low_latency(buf, p, xs, idxs, ws, me)
    return int(got.recv_x.shape[0])


def check_low_latency(buf, p: Placement, xs, idxs, ws, me: int) -> None:
    """Low-latency mode sums per (token, k) in k order: exact with any values, random ones here."""
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(x.shape, generator=gen) for x in xs]
    T = 8
    ref = reference.low_latency_dispatch(xs, idxs, E_MP, T)
    ys = [r.recv_x_LMX * (torch.arange(E_MP // R_MP) + rank * (E_MP // R_MP) + 1.0)[:, None, None]
          for rank, r in enumerate(ref)]  # fmt: skip
    want = reference.low_latency_combine(ys, ref, idxs, ws)[me]
    got = buf.low_latency_dispatch(xs[me], idxs[me], T, E_MP)
    y = got.recv_x * (p.local_logical(me) + 1.0)[:, None, None]
    combined = buf.low_latency_combine(y, idxs[me], ws[me], got.handle).combined_x
    assert torch.equal(combined, want), f"low latency, rank {me}"


@pytest.mark.parametrize("per_node", [R_MP, 2], ids=["one-node-shm", "two-nodes-hier"])
def test_redundant_experts_combine_bit_exact_against_the_logical_reference(per_node):
    launch = ubep.LocalLaunch(world_size=R_MP, ranks_per_node=per_node, timeout_s=120)
    received = launch.run(placed_rank, per_node)
    assert sum(received) > 0


def test_set_placement_refuses_a_placement_of_another_size():
    with ubep.Buffer(hidden=8, num_experts=6, max_tokens_per_rank=4) as buf:
        with pytest.raises(ValueError, match="6 experts on 1 ranks"):
            buf.set_placement(Placement.identity(4, 1))
        buf.set_placement(Placement.from_list([0, 1, 2, 0, 1, 0], 1, 3))
        idx = torch.tensor([[0, 2], [0, 1]])
        got = buf.dispatch(torch.ones(2, 8), topk_idx=idx, topk_weights=torch.full((2, 2), 0.5))
        assert got.recv_topk_idx.tolist() == [[0, 2], [3, 1]]  # expert 0's pairs alternate its copies
        with pytest.raises(ValueError, match=r"\[-1, 3\)"):
            buf.dispatch(torch.ones(1, 8), topk_idx=torch.tensor([[3, 0]]), topk_weights=torch.ones(1, 2))
        buf.set_placement(None)
        assert buf.dispatch(torch.ones(1, 8), topk_idx=torch.tensor([[5, 0]]), topk_weights=torch.ones(1, 2))


def cached_dispatch_across_set_placement(rank) -> bool:
    """A handle from before set_placement routes to the old slots: its cached dispatch is refused
    on every rank alike (the group stays in step), and a fresh dispatch is exact."""
    sc = Scenario(name="placed-stale", num_ranks=2, num_experts=4, hidden=8, topk=2, tokens=(3, 2), seed=7)
    xs, idxs, ws, ref = sc.expected()
    me = rank.rank
    with ubep.Buffer(rank, hidden=8, num_experts=4, max_tokens_per_rank=4, timeout_s=30) as buf:
        before = buf.dispatch(xs[me], topk_idx=idxs[me], topk_weights=ws[me])
        buf.set_placement(Placement.from_list([1, 0, 3, 2], 2, 4))  # each rank's two slots swapped
        with pytest.raises(ValueError, match=r"handle comes from a dispatch before set_placement"):
            buf.dispatch(xs[me], handle=before.handle)
        after = buf.dispatch(xs[me], topk_idx=idxs[me], topk_weights=ws[me])
        buf.set_placement(Placement.from_list([1, 0, 3, 2], 2, 4))  # the same placement again: no change
        again = buf.dispatch(xs[me], handle=after.handle)
    return torch.equal(after.recv_x, ref[me].recv_x_MH) and torch.equal(again.recv_x, ref[me].recv_x_MH)


@pytest.mark.timeout(120)
def test_a_handle_from_before_set_placement_is_refused_for_a_cached_dispatch():
    """Issue 32, item 9: it was accepted, and repeated the old slots' routing silently."""
    assert VirtualWorld(2, timeout_s=60).run(cached_dispatch_across_set_placement) == [True, True]


# -- where a user looks: ubep simulate / ubep bench --placement ----------------------------------------


def test_simulate_placements_side_by_side(tmp_path):
    import json

    from ubep.cli import main

    path = tmp_path / "placed.json"
    args = ["simulate", "--topology", "cm384", "--ranks", "16", "--tokens", "16", "--routing", "zipf",
            "--skew", "1.2", "--placement", "none,eplb,ubep", "--protocol", "ubep", "--workers", "4",
            "--json", str(path)]  # fmt: skip
    assert main(args) == 0
    rows = {r["placement"]: r for r in json.loads(path.read_text())["placement"]}
    assert set(rows) == {"none", "eplb", "ubep"}
    assert rows["ubep"]["imbalance"] <= 1.15 < rows["none"]["imbalance"]
    assert rows["ubep"]["cross_node_pairs"] < rows["eplb"]["cross_node_pairs"]
    assert all(r["dispatch_us"] > 0 and r["ranks"] == 16 for r in rows.values())


def test_bench_placement_rows_are_checked_and_timed(tmp_path):
    import json

    from ubep.cli import main

    out = tmp_path / "placed.json"
    args = ["bench", "--ranks", "4", "--nodes", "2", "--tokens", "16", "--hidden", "64", "--experts", "16",
            "--topk", "4", "--iters", "2", "--warmup", "1", "--routing", "zipf", "--skew", "1.2",
            "--placement", "none,eplb,ubep", "--systems", "ubep", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    rows = {r["system"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"ubep", "ubep+eplb", "ubep+placed"}  # each verified against the reference first
    assert all(r["boundary_bytes"] > 0 and r["vs_ubep"] > 0 for r in rows.values())


def test_a_combine_maps_as_its_dispatch_did_after_two_masks_inside_one_call():
    """A low-latency combine repeats its dispatch's copy map (`PlacedSlots.physical_at`): a host's two
    ranks found dead one round after the other inside the combine mask twice before it runs again,
    and the map from before both masks, not the one between them, is the dispatch's."""
    from ubep.bench.elastic import copied_placement
    from ubep.layout import ExpertPlacement
    from ubep.placement.slots import PlacedSlots

    placement = copied_placement(12, 3, 2, 4)  # 3 hosts of 2 ranks, every expert on two hosts
    nodes = [0, 0, 1, 1, 2, 2]

    def slots(masked: frozenset[int]) -> PlacedSlots:
        s = PlacedSlots(ExpertPlacement.contiguous(24, 6), 0, nodes)
        s.hold(placement, 0)
        if masked:
            s.leave_out(masked, 0, 0)
        return s

    ids_NK = torch.arange(12, dtype=torch.int64, device="cpu").view(3, 4)
    whole, between = slots(frozenset()).physical(ids_NK), slots(frozenset({3})).physical(ids_NK)
    assert not torch.equal(whole, between)  # rank 0 reaches some expert's nearest copy on rank 3
    held = slots(frozenset())
    held.leave_out(frozenset({3}), 7, 0)  # the combine, call 8, masks rank 3: resume after 7
    held.leave_out(frozenset({2, 3}), 8, 0)  # its run again, call 8, masks rank 2 too
    assert torch.equal(held.physical_at(ids_NK, 6), whole)  # dispatch 6: before both masks
    assert torch.equal(held.physical_at(ids_NK, 8), between)
    assert torch.equal(held.physical_at(ids_NK, 9), slots(frozenset({2, 3})).physical(ids_NK))
    held.leave_out(frozenset({2, 3, 5}), 12, 10)  # a mask that made handles up to 10 stale
    assert [last for last, _ in held.maps_before] == [12]  # the maps only refused handles used: gone

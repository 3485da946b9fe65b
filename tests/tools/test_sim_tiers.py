"""ubep.sim.tiers (issue 44 item 4): the bytes each schedule puts on each tier, counted by hand on 2
racks of 2 hosts of 2 ranks, and the simulator's time ordered as those bytes say where the slow tier
binds."""

from __future__ import annotations

import numpy as np
import pytest

from ubep.sim.tiers import Stack, hop_rows, predict_us, tier_bytes

STACK = Stack(racks=2, hosts_per_rack=2, ranks_per_host=2, link_gbps=0.125, rack_gbps=0.0125)
H, ITEM, K = 64, 2, 4
B, META = H * ITEM, 8 + 12 * K  # a row, and the routing beside a row crossing hosts (hier, tiers)


def one_token_to_rack_1() -> np.ndarray:
    """Rank 0's one token goes to every rank of rack 1 (ranks 4..7) and to rank 1 (its host peer)."""
    hit_RNR = np.zeros((8, 1, 8), dtype=bool)
    hit_RNR[0, 0, [1, 4, 5, 6, 7]] = True
    return hit_RNR


def test_each_schedule_crosses_the_slow_tier_as_often_as_it_says():
    hit = one_token_to_rack_1()
    slow = {s: tier_bytes(s, STACK, hit, H, ITEM, K)["slow"] for s in ("dist", "hier", "tiers")}
    assert slow["dist"] == 4 * ((B + 8 * (1 + 2 * K)) + B)  # to ranks 4..7, each a row out and back
    assert slow["hier"] == 2 * ((B + META) + 4 * H)  # to hosts 2 and 3 (ranks 4 and 6), float32 back
    assert slow["tiers"] == 1 * ((B + META) + 4 * H)  # to rack 1 once (rank 4, rank 0's place there)
    fast = tier_bytes("tiers", STACK, hit, H, ITEM, K)["fast"]
    assert fast == (B + 8 + META) + 4 * H  # rank 4 to rank 6 (host 3, local index 0), source rank beside
    assert tier_bytes("hier", STACK, hit, H, ITEM, K)["fast"] == 0  # hier crosses no host within rack 0


def test_the_hops_of_the_three_tier_schedule():
    first, second, third = hop_rows("tiers", STACK, one_token_to_rack_1())
    assert {tuple(p) for p in np.argwhere(first)} == {(0, 0), (0, 4)}  # kept, and to rack 1
    assert {tuple(p) for p in np.argwhere(second)} == {(0, 0), (4, 4), (4, 6)}
    assert {tuple(p) for p in np.argwhere(third)} == {(0, 1), (4, 4), (4, 5), (6, 6), (6, 7)}


@pytest.mark.parametrize("tokens", [8, 128])
def test_where_the_slow_tier_binds_the_simulator_orders_tiers_hier_dist(tokens):
    """Every rank sends `tokens` tokens, each to every rank: the slow tier carries the most rows flat,
    fewer per host, fewest per rack, and at 1/10 of the links' rate that orders the times."""
    hit = np.ones((8, tokens, 8), dtype=bool)
    times = {s: sum(predict_us(s, STACK, hit, 1024, ITEM, K)) for s in ("dist", "hier", "tiers")}
    assert times["tiers"] < times["hier"] < times["dist"], times


def test_a_racks_run_says_the_command_that_repeats_it():
    """The results table's command of a --racks run names the racks and their uplinks (and no
    --systems: the four rack rows are its default)."""
    from ubep.bench.results import command
    from ubep.bench.workload import RACK_SYSTEMS, BenchConfig

    cfg = BenchConfig(nodes=4, namespaces=True, link_rate="1gbit", racks=2, rack_link_rate="100mbit",
                      systems=RACK_SYSTEMS)  # fmt: skip
    assert command(cfg) == "ubep bench --hosts 4 --link-rate 1gbit --racks 2 --rack-link-rate 100mbit"
    assert RACK_SYSTEMS == ("ubep-tiers", "ubep", "ubep-dist", "hier-bsp")


def test_racks_need_their_uplinks_rate_and_must_divide_the_hosts():
    pytest.importorskip("rich")
    from ubep.cli import main

    for racks, rate in (("2", ""), ("3", "100mbit")):
        with pytest.raises(
            SystemExit, match=r"--racks \(\d\) must divide --hosts \(4\), with --rack-link-rate"
        ):
            main(["bench", "--hosts", "4", "--racks", racks, "--rack-link-rate", rate, "--tokens", "8"])


def test_the_bytes_crossing_hosts_are_boundary_bytes_for_flat_and_per_host():
    """Across hosts (either tier), the flat and the per-host schedules move what
    `bsp_hier.boundary_bytes` counts (its dedup and flat counts are checked against the rows the
    exchanges really send), on a random routing of 2 racks of 2 hosts of 2 ranks."""
    import torch

    from ubep import routing
    from ubep.across.collectives.bsp_hier import boundary_bytes
    from ubep.layout import ExpertPlacement, token_in_rank

    gen, placement = torch.Generator().manual_seed(4), ExpertPlacement.contiguous(32, 8)
    idxs = [routing.make("uniform", 24, 32, K, gen) for _ in range(8)]
    hit = np.stack([token_in_rank(i, placement).numpy() for i in idxs])
    counted = boundary_bytes(idxs, placement, [r // 2 for r in range(8)], H, torch.bfloat16)
    for schedule, kind in (("dist", "flat"), ("hier", "dedup")):
        got = tier_bytes(schedule, STACK, hit, H, ITEM, K)
        want = sum(counted[f"dispatch_bytes_{kind}"]) + sum(counted[f"combine_bytes_{kind}"])
        assert got["slow"] + got["fast"] == want, (schedule, got, want)
    tiers = tier_bytes("tiers", STACK, hit, H, ITEM, K)
    assert tiers["slow"] < tier_bytes("hier", STACK, hit, H, ITEM, K)["slow"]

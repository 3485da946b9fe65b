"""Every heap protocol on the virtual-ranks transport (R ranks as threads of this process),
against the same reference and with the same checks as on shared memory, on each CPU engine."""

from __future__ import annotations

import pytest
from scenarios import scenarios_for
from test_exchange import check_scenario
from test_low_latency import CAPACITY, HIDDEN, cases, run_case

import ubep
from ubep.transport.virtual import VirtualRank, VirtualWorld

ENGINES = ["torch", "numba"]


def normal_mode(rank: VirtualRank, protocol: str, engine: str) -> int:
    checked = 0
    for sc in scenarios_for(rank.world_size):
        with ubep.Buffer(
            rank,
            hidden=sc.hidden,
            num_experts=sc.num_experts,
            max_tokens_per_rank=sc.capacity,
            protocol=protocol,
            engine=engine,
            timeout_s=20,
        ) as buf:
            assert buf.transport == "virtual" and buf.engine.name == engine
            check_scenario(buf, sc, rank.rank)
            checked += 1
    return checked


@pytest.mark.timeout(180)
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("protocol", ["ubep", "bsp"])
def test_normal_mode_matches_reference(protocol, world_size, engine):
    world = VirtualWorld(world_size, timeout_s=150)
    counts = world.run(lambda rank: normal_mode(rank, protocol, engine))
    assert counts == [len(scenarios_for(world_size))] * world_size


def low_latency(rank: VirtualRank, engine: str) -> int:
    R, E = rank.world_size, 2 * rank.world_size
    with ubep.Buffer(
        rank, hidden=HIDDEN, num_experts=E, max_tokens_per_rank=CAPACITY, engine=engine, timeout_s=20
    ) as buf:
        for case in cases(R):
            run_case(buf, case, rank.rank, R, E)
    return len(cases(R))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("world_size", [2, 4])
def test_low_latency_matches_reference(world_size, engine):
    world = VirtualWorld(world_size, timeout_s=150)
    assert world.run(lambda rank: low_latency(rank, engine)) == [len(cases(world_size))] * world_size


def test_a_failing_rank_is_named_and_the_others_are_not_left_waiting():
    def body(rank: VirtualRank) -> None:
        with ubep.Buffer(rank, hidden=64, num_experts=4, max_tokens_per_rank=8, timeout_s=5) as buf:
            if rank.rank == 1:
                raise RuntimeError("rank 1 gives up")
            x, idx, w = (t for t in _inputs())
            buf.dispatch(x, topk_idx=idx, topk_weights=w)

    with pytest.raises(RuntimeError, match="virtual rank"):
        VirtualWorld(2, timeout_s=30).run(body)


def _inputs():
    import torch

    return torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(4, 2, dtype=torch.int64), torch.ones(4, 2)

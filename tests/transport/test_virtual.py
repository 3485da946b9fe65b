"""Every heap protocol on the virtual-ranks transport (R ranks as threads of this process),
against the same reference and with the same checks as on shared memory, on each CPU engine."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from repo import ROOT
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
        rank,
        hidden=HIDDEN,
        num_experts=E,
        max_tokens_per_rank=CAPACITY,
        engine=engine,
        timeout_s=20,
        low_latency=True,
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
    """Rank 0 waits in dispatch for rank 1, which raised: it is told at once, not at its deadline."""

    def body(rank: VirtualRank) -> None:
        with ubep.Buffer(rank, hidden=64, num_experts=4, max_tokens_per_rank=8, timeout_s=20) as buf:
            if rank.rank == 1:
                raise RuntimeError("rank 1 gives up")
            x, idx, w = _inputs()
            buf.dispatch(x, topk_idx=idx, topk_weights=w)

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="virtual rank 1 failed: RuntimeError"):
        VirtualWorld(2, timeout_s=30).run(body)
    assert time.monotonic() - start < 20  # before the Buffer's deadline


def test_a_construction_failure_names_the_rank_that_failed():
    """Rank 2's arguments fail its own checks; ranks 0 and 1, waiting for it in the handshake, only
    follow. The error is rank 2's, not a timeout of theirs."""

    def body(rank: VirtualRank) -> None:
        experts = 5 if rank.rank == 2 else 6
        ubep.Buffer(rank, hidden=64, num_experts=experts, max_tokens_per_rank=8, engine="torch").close()

    with pytest.raises(RuntimeError, match=r"virtual rank 2 failed: ValueError\('num_experts \(5\)"):
        VirtualWorld(3, timeout_s=30).run(body)


def test_run_calls_fn_with_each_virtual_rank_as_the_readme_says():
    readme = open(os.path.join(ROOT, "README.md")).read()
    said = " ".join(readme[readme.index("VirtualWorld(R).run(fn)") :].split()[:12])
    assert "calls `fn(rank)` in each, `rank` a `VirtualRank` (its index is `rank.rank`)" in said
    ranks = VirtualWorld(3).run(lambda rank: rank)
    assert all(isinstance(r, VirtualRank) for r in ranks)
    assert [(r.rank, r.world_size) for r in ranks] == [(0, 3), (1, 3), (2, 3)]


STUCK_RANK = """
import threading
from ubep.transport.virtual import VirtualWorld

never = threading.Event()
try:
    VirtualWorld(2, timeout_s=0.5).run(lambda rank: rank.rank == 1 and never.wait())
except Exception as error:
    print(type(error).__name__, error)
"""


def test_a_stuck_rank_does_not_keep_the_interpreter_from_exiting():
    """Rank 1 never returns: run() raises at the world's deadline and the program then exits."""
    src = os.path.join(ROOT, "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    try:
        done = subprocess.run(
            [sys.executable, "-c", STUCK_RANK], env=env, capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the interpreter did not exit while a virtual rank's thread was stuck")
    assert done.returncode == 0, done.stderr
    assert "CommTimeoutError virtual world run: no signal from rank(s) 1" in done.stdout


def _inputs():
    """Four tokens, each to experts 0 and 1 (distinct, so the call itself is valid)."""
    import torch

    idx = torch.tensor([[0, 1]] * 4, dtype=torch.int64)
    return torch.zeros(4, 64, dtype=torch.bfloat16), idx, torch.ones(4, 2)

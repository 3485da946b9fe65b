"""The local launcher: results in rank order, failures named, deadlines kept, no leftovers."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch.distributed as dist

import ubep
from ubep.launcher import LocalLaunch, RankFailedError


def whoami() -> tuple[int, int, str, str]:
    return dist.get_rank(), dist.get_world_size(), os.environ["LOCAL_RANK"], os.environ["GROUP_RANK"]


def fail_on_rank_two() -> int:
    if dist.get_rank() == 2:
        raise KeyError("rank two's own failure")
    time.sleep(30)  # the others would run long; the launcher must stop them
    return dist.get_rank()


def die_on_rank_one() -> int:
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return dist.get_rank()


def hang() -> None:
    time.sleep(60)


def test_results_in_rank_order_with_emulated_nodes():
    got = LocalLaunch(world_size=4, ranks_per_node=2, timeout_s=60).run(whoami)
    assert got == [(0, 4, "0", "0"), (1, 4, "1", "0"), (2, 4, "0", "1"), (3, 4, "1", "1")]


def test_failing_rank_is_named_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 2 failed") as info:
        LocalLaunch(world_size=3, timeout_s=60).run(fail_on_rank_two)
    assert "rank two's own failure" in str(info.value) and info.value.rank == 2
    assert time.monotonic() - start < 20, "the other ranks were not stopped"


def test_killed_rank_reported_by_outcomes():
    outcomes = LocalLaunch(world_size=3, timeout_s=60).outcomes(die_on_rank_one)
    assert [o.ok for o in outcomes] == [True, False, True]
    assert outcomes[1].cause == "died" and outcomes[1].exit_code == -signal.SIGKILL


def test_deadline_kills_hung_ranks():
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="still running"):
        LocalLaunch(world_size=2, timeout_s=3).run(hang)
    assert time.monotonic() - start < 15


def test_one_rank_runs_inline():
    assert LocalLaunch(world_size=1).run(os.getpid) == [os.getpid()]


def test_buffer_joins_the_launched_group():
    def explain() -> str:
        with ubep.Buffer(hidden=8, num_experts=4, max_tokens_per_rank=4) as buf:
            return buf.explain()

    lines = LocalLaunch(world_size=2, timeout_s=60).run(explain)
    assert "transport shm" in lines[0] and "rank 1/2" in lines[1]

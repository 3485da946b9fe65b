"""The local launcher: results in rank order, failures named, deadlines kept, no leftovers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist
from repo import SRC

import ubep
from ubep.launcher import LocalLaunch, RankFailedError


def whoami() -> tuple[int, int, str, str]:
    return dist.get_rank(), dist.get_world_size(), os.environ["LOCAL_RANK"], os.environ["GROUP_RANK"]


OTHERS_RUN_S = 30.0  # how long the ranks that do not fail would run
HANG_S = 60.0


def fail_on_rank_two() -> int:
    if dist.get_rank() == 2:
        raise KeyError("rank two's own failure")
    time.sleep(OTHERS_RUN_S)  # the others would run long; the launcher must stop them
    return dist.get_rank()


def die_on_rank_one() -> int:
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return dist.get_rank()


def hang() -> None:
    time.sleep(HANG_S)


def test_results_in_rank_order_with_emulated_nodes():
    got = LocalLaunch(world_size=4, ranks_per_node=2, timeout_s=60).run(whoami)
    assert got == [(0, 4, "0", "0"), (1, 4, "1", "0"), (2, 4, "0", "1"), (3, 4, "1", "1")]


def test_failing_rank_is_named_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 2 failed") as info:
        LocalLaunch(world_size=3, timeout_s=60).run(fail_on_rank_two)
    assert "rank two's own failure" in str(info.value) and info.value.rank == 2
    assert time.monotonic() - start < OTHERS_RUN_S, "the other ranks were not stopped"


def test_killed_rank_reported_by_outcomes():
    outcomes = LocalLaunch(world_size=3, timeout_s=60).outcomes(die_on_rank_one)
    assert [o.ok for o in outcomes] == [True, False, True]
    assert outcomes[1].cause == "died" and outcomes[1].exit_code == -signal.SIGKILL


def test_deadline_kills_hung_ranks():
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="still running"):
        LocalLaunch(world_size=2, timeout_s=3).run(hang)
    assert time.monotonic() - start < HANG_S  # the launcher's deadline of 3 s, not the hang's end


def test_a_lambda_or_nested_function_is_refused_with_what_to_do():
    def nested() -> int:
        return 1

    for fn in (nested, lambda: 1):
        with pytest.raises(TypeError, match=r"cannot send .* by pickling .*not a lambda, nor one defined"):
            LocalLaunch(world_size=2, timeout_s=30).run(fn)


TYPED_AT_A_PROMPT = """
import ubep

def typed_here():
    return 1

class Typed:
    pass

for fn, args in ((typed_here, ()), (repr, (Typed(),))):
    try:
        ubep.LocalLaunch(world_size=2, timeout_s=60).run(fn, *args)
    except Exception as error:
        print(type(error).__name__, str(error).replace("\\n", " "))
"""


def test_a_function_typed_into_python_c_is_refused_with_what_to_do():
    """Under `python -c` (as in a REPL or a notebook) the ranks cannot import `__main__`'s names:
    a function is refused before any rank starts; an argument of such a class fails in every rank,
    which says why (before: "rank 0 failed: exited with code 1 and no result")."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-c", TYPED_AT_A_PROMPT], env=env, capture_output=True, text=True, timeout=120
    )
    refused, unloadable = done.stdout.splitlines()
    assert refused.startswith("TypeError LocalLaunch cannot run typed_here: it is defined in an interactive")
    assert refused.endswith("Put it in a .py file and import it from there, or run a script.")
    assert unloadable.startswith("RankFailedError rank ")
    assert "Can't get attribute 'Typed'" in unloadable
    assert "could not load the function or its arguments sent by LocalLaunch" in unloadable


def test_one_rank_runs_inline():
    assert LocalLaunch(world_size=1).run(os.getpid) == [os.getpid()]


def explain() -> str:
    with ubep.Buffer(hidden=8, num_experts=4, max_tokens_per_rank=4) as buf:
        return buf.explain()


def test_buffer_joins_the_launched_group():
    lines = LocalLaunch(world_size=2, timeout_s=60).run(explain)
    assert "transport shm" in lines[0] and "rank 1/2" in lines[1]

"""Blame: a failure names the rank at fault, never a survivor, and says so honestly where it
cannot know. Process identities (pid, PID namespace, start time) instead of bare pids; a
rank killed before the shared heap's first all-gather; a stopped rank on torch.distributed
while a survivor that gave up on it exits."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import torch
import torch.distributed as dist
from faultcase import iteration, make_buffer, scenario

import ubep
from ubep.calls import CallId
from ubep.errors import CommTimeoutError
from ubep.transport.heap import Heap, Layout
from ubep.waiting import ProcessId, pid_namespace, start_time

# -- identities -------------------------------------------------------------------------------------


def exited_pid() -> int:
    """The pid of a child that ran, exited and was reaped."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def stopped_child() -> subprocess.Popen:
    child = subprocess.Popen(["sleep", "30"])
    os.kill(child.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with open(f"/proc/{child.pid}/stat", "rb") as f:
            if f.read().rsplit(b")", 1)[1].split()[0] == b"T":
                break
        time.sleep(0.01)
    return child


def test_identity_proves_exit_and_stop_only_in_this_pid_namespace():
    child = stopped_child()
    try:
        me = ProcessId(child.pid, pid_namespace(), start_time(str(child.pid)))
        assert me.is_stopped() and not me.is_gone()
        elsewhere = ProcessId(child.pid, pid_namespace() + 1, me.start)
        assert not elsewhere.is_stopped(), "a pid of another namespace names some other process here"
        assert not ProcessId(child.pid, me.pid_ns, me.start + 1).is_stopped(), "a reused pid: not it"
        os.kill(child.pid, signal.SIGCONT)
        time.sleep(0.05)
        assert not me.is_stopped() and not me.is_gone()
    finally:
        child.kill()
        child.wait()
    assert me.is_gone() and not me.is_stopped()
    assert not ProcessId(child.pid, me.pid_ns + 1, me.start).is_gone(), "another namespace: never judged"


class Arenas:
    """A `Memory` of plain tensors: a heap with no peer that ever signals."""

    def __init__(self, num_ranks: int, nbytes: int):
        self._arenas = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(num_ranks)]

    def arena(self, owner: int) -> torch.Tensor:
        return self._arenas[owner]

    def ring(self, peer: int) -> None:
        pass

    def sleep(self, timeout_s: float) -> None:
        time.sleep(min(timeout_s, 0.01))

    def close(self) -> None:
        self._arenas = []


def wait_on_silent_peer(peer: ProcessId, timeout_s: float) -> tuple[CommTimeoutError, float]:
    layout = Layout(2, [])
    heap = Heap(layout, Arenas(2, layout.nbytes), 0, 2, timeout_s=timeout_s)
    heap.learn_peers([ProcessId.this_process(), peer])
    start = time.monotonic()
    with pytest.raises(CommTimeoutError) as caught:
        heap.wait("probe", CallId(1, 1, "dispatch"), [1], lambda r: False)
    return caught.value, time.monotonic() - start


def test_heap_waits_judge_peers_by_identity_not_by_bare_pid():
    pid = exited_pid()  # free here: a bare-pid check calls any process with this pid dead
    error, elapsed = wait_on_silent_peer(ProcessId(pid, pid_namespace() + 1, 1), timeout_s=1.0)
    assert error.dead_peers == [] and elapsed >= 1.0, (str(error), elapsed)  # only the deadline may tell
    error, elapsed = wait_on_silent_peer(ProcessId(pid, pid_namespace(), 1), timeout_s=30.0)
    assert error.dead_peers == [1] and elapsed < 30.0, (str(error), elapsed)  # our namespace: seen at once


# -- ranks killed or stopped --------------------------------------------------------------------------


def killed_joining() -> str:
    """Rank 2 dies just before the Buffer's first collective (joining the group): nobody can know who."""
    if dist.get_rank() == 2:
        dist.all_gather_object = lambda *args, **kw: os.kill(os.getpid(), signal.SIGKILL)
    try:
        ubep.Buffer(hidden=16, num_experts=6, max_tokens_per_rank=8, timeout_s=2).close()
    except ubep.UbepError as error:
        return f"{type(error).__name__}: {error}"
    return "built"


@pytest.mark.timeout(60)
def test_a_rank_killed_before_anyone_is_known_is_reported_without_blaming_a_survivor():
    outcomes = ubep.LocalLaunch(world_size=3, timeout_s=40).outcomes(killed_joining)
    for rank in (0, 1):
        error = outcomes[rank].result
        assert "did not arrive; one of them may have died" in error, error
        assert "died (process exited" not in error and "no signal" not in error, error


def stopped_while_a_survivor_exits() -> tuple[str, float]:
    """Rank 2 stops itself; rank 1 gives up after 1 s and exits; rank 0 waits 3 s, then kills rank 2."""
    me, pids = dist.get_rank(), [0] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    sc = scenario()
    buf = make_buffer(sc, "bsp", "dist", timeout_s=1.0 if me == 1 else 3.0)
    iteration(buf, sc, me)
    if me == 2:
        os.kill(os.getpid(), signal.SIGSTOP)
    start = time.monotonic()
    try:
        iteration(buf, sc, me)
        outcome = "completed"
    except ubep.UbepError as error:
        outcome = f"{type(error).__name__}: {error}"
    if me == 0:
        os.kill(pids[2], signal.SIGKILL)
    return outcome, time.monotonic() - start


@pytest.mark.timeout(90)
def test_bsp_over_dist_names_the_stopped_rank_not_the_survivor_that_exited():
    outcomes = ubep.LocalLaunch(world_size=3, timeout_s=60).outcomes(stopped_while_a_survivor_exits)
    for rank, timeout_s in ((0, 3.0), (1, 1.0)):
        error, elapsed = outcomes[rank].result
        assert error.startswith("CommTimeoutError"), error
        assert "no signal from rank(s) 2 after" in error and "rank(s) 2 stopped" in error, error
        assert "rank(s) 1" not in error and "rank(s) 0" not in error, error
        assert elapsed < 3 * timeout_s + 1.0, (error, elapsed)  # the bound docs/reliability.md gives

"""No shared-memory segment of ours outlives its Buffer: after close(), after an
exception, and after the launcher kills ranks."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import ubep
from ubep.launcher import LocalLaunch
from ubep.transport.segments import NAME_PREFIX, SHM_DIR, Creator, segment_pid, sweep_stale_segments


def ours(pids: set[int] | None = None) -> list[str]:
    names = [n for n in os.listdir(SHM_DIR) if n.startswith(NAME_PREFIX)]
    return names if pids is None else [n for n in names if segment_pid(n) in pids]


def build_and_report(close: bool) -> tuple[int, list[str]]:
    buf = ubep.Buffer(hidden=16, num_experts=8, max_tokens_per_rank=8)
    seen_while_open = ours({os.getpid()})
    if close:
        buf.close()
    return os.getpid(), seen_while_open


def raise_inside() -> int:
    with ubep.Buffer(hidden=16, num_experts=8, max_tokens_per_rank=8):
        x = torch.randn(2, 16)
        raise RuntimeError(f"user code failed after {x.shape[0]} rows")


def kill_after_build() -> int:
    buf = ubep.Buffer(hidden=16, num_experts=8, max_tokens_per_rank=8)
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(30)
    return buf.rank


@pytest.mark.parametrize("close", [True, False])
def test_nothing_left_once_built(close):
    before = set(ours())
    results = LocalLaunch(world_size=4, timeout_s=60).run(build_and_report, close)
    assert all(seen == [] for _, seen in results), "names must be unlinked once every rank mapped them"
    assert set(ours()) <= before


def test_nothing_left_after_exception():
    before = set(ours())
    with pytest.raises(ubep.RankFailedError, match="user code failed"):
        LocalLaunch(world_size=2, timeout_s=60).run(raise_inside)
    assert set(ours()) <= before


def test_nothing_left_after_launcher_kills_ranks():
    before = set(ours())
    with pytest.raises(ubep.RankFailedError, match="rank 1 failed"):
        LocalLaunch(world_size=4, timeout_s=60).run(kill_after_build)
    assert set(ours()) <= before


def plant(name: str) -> str:
    path = os.path.join(SHM_DIR, name)
    with open(path, "wb") as f:
        f.write(b"\0" * 64)
    os.chmod(path, 0o600)
    return path


def test_stale_segment_of_a_dead_creator_is_swept():
    dead_pid = 2**22 + 12345  # above the default pid_max: never a live process
    here = Creator.this_process()
    dead = plant(f"{NAME_PREFIX}{dead_pid}-{here.pid_ns}-{here.start}-feedface")
    reused = plant(f"{NAME_PREFIX}{here.pid}-{here.pid_ns}-{here.start + 1}-feedface")  # our pid, reused
    try:
        LocalLaunch(world_size=2, timeout_s=60).run(build_and_report, True)
        assert not os.path.exists(dead) and not os.path.exists(reused)
    finally:
        for path in (dead, reused):
            if os.path.exists(path):
                os.unlink(path)


def test_sweep_removes_only_what_it_can_prove_dead():
    dead_pid = 2**22 + 12346
    here = Creator.this_process()
    kept = [
        plant(f"{NAME_PREFIX}{dead_pid}-feedface"),  # an older format: no start time, no namespace
        plant(f"{NAME_PREFIX}{dead_pid}-{here.pid_ns + 1}-{here.start}-feedface"),  # another namespace
        plant(f"{NAME_PREFIX}{here.pid}-{here.pid_ns}-{here.start}-feedface"),  # alive: this process
    ]
    try:
        removed = sweep_stale_segments()
        assert all(os.path.exists(p) for p in kept), removed
    finally:
        for path in kept:
            os.unlink(path)

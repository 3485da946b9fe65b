"""Shared segments: unguessable names, mode 0600, owner and mode checked on attach,
an attacker's pre-created or swapped segment refused, and nothing left behind when
construction fails half way. (Cleanup after close, exceptions and kills: see
test_cleanup.py and the residue checks in test_faults.py.)"""

from __future__ import annotations

import os
import stat
import time

import pytest
import torch.distributed as dist
from faultcase import group_pids, residue

import ubep
import ubep.transport.segments
from ubep.transport.segments import (
    NAME_PREFIX,
    SHM_DIR,
    _attach,
    _create,
    segment_creator,
    segment_name,
    segment_pid,
    sweep_stale_segments,
)

NOBODY = 65534
as_root = pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")


@pytest.fixture
def path():
    name = segment_name(os.getpid())
    full = os.path.join(SHM_DIR, name)
    yield name, full
    if os.path.lexists(full):
        os.unlink(full)


def plant(full: str, mode: int = 0o600, nbytes: int = 4096) -> None:
    """A segment as an attacker (or a stale run) would leave it."""
    fd = os.open(full, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    os.ftruncate(fd, nbytes)
    os.close(fd)
    os.chmod(full, mode)


def test_names_are_unguessable_and_carry_the_pid():
    names = {segment_name(1234) for _ in range(64)}
    assert len(names) == 64
    for name in names:
        assert name.startswith(f"{NAME_PREFIX}1234-") and segment_pid(name) == 1234
        assert len(name.split("-", 2)[2]) >= 24, "at least 96 random bits"
    assert segment_pid("ubep-notapid-00") is None and segment_pid("other-12-ab") is None


def test_created_segment_is_private(path):
    name, full = path
    _create(name, 4096).close()
    info = os.stat(full)
    assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.getuid()


def test_create_refuses_a_name_that_exists(path):
    name, full = path
    plant(full)
    with pytest.raises(FileExistsError):
        _create(name, 4096)


@pytest.mark.parametrize("mode", [0o644, 0o660, 0o606])
def test_attach_refuses_a_segment_others_can_reach(path, mode):
    name, full = path
    plant(full, mode)
    with pytest.raises(PermissionError, match="unexpected owner or mode"):
        _attach(name, 4096)


@as_root
def test_attach_refuses_a_segment_owned_by_another_user(path):
    name, full = path
    plant(full)
    os.chown(full, NOBODY, NOBODY)
    with pytest.raises(PermissionError, match="unexpected owner or mode"):
        _attach(name, 4096)


def test_attach_refuses_a_symlink(path, tmp_path):
    name, full = path
    target = tmp_path / "elsewhere"
    target.write_bytes(b"\0" * 4096)
    os.chmod(target, 0o600)
    os.symlink(target, full)
    with pytest.raises(OSError):
        _attach(name, 4096)


def test_attach_refuses_a_short_segment(path):
    name, full = path
    plant(full, nbytes=64)
    with pytest.raises(ValueError, match="is 64 bytes, expected 4096"):
        _attach(name, 4096)


@as_root
def test_sweep_leaves_other_users_and_live_creators_alone():
    dead_pid = 2**22 + 4321  # above the default pid_max: never a live process
    here = segment_creator(segment_name(os.getpid()))
    theirs = os.path.join(
        SHM_DIR, f"{NAME_PREFIX}{dead_pid}-{here.pid_ns}-{here.start}-aaaa"
    )  # provably dead
    live = os.path.join(SHM_DIR, segment_name(os.getpid()))
    plant(theirs)
    os.chown(theirs, NOBODY, NOBODY)
    plant(live)
    try:
        removed = sweep_stale_segments()
        assert os.path.exists(theirs) and os.path.exists(live), removed
    finally:
        os.unlink(theirs)
        os.unlink(live)


def tampered_attach(timeout_s: float) -> tuple[str, list[str]]:
    """Rank 1 finds a peer's segment tampered with (its attach refuses): construction
    fails on every rank, and every rank's half-built segment must be gone."""
    pids, start = group_pids(), time.monotonic()
    if dist.get_rank() == 1:

        def refuse(name: str, nbytes: int):
            raise PermissionError(f"shared segment {name} has an unexpected owner or mode")

        ubep.transport.segments._attach = refuse  # this rank's process only
    try:
        ubep.Buffer(hidden=16, num_experts=6, max_tokens_per_rank=8, timeout_s=timeout_s).close()
        outcome = "built"
    except (PermissionError, ubep.UbepError) as error:
        outcome = f"{type(error).__name__}: {error}"
    if dist.get_rank() == 1:  # leave at once: the peers blocked on it fail when it exits
        return outcome, residue({os.getpid()})
    time.sleep(max(0.0, start + 4 * timeout_s - time.monotonic()))  # every peer has failed by then
    return outcome, residue(pids)


def test_failed_construction_leaves_no_segment():
    results = ubep.LocalLaunch(world_size=3, timeout_s=60).run(tampered_attach, 2.0)
    assert results[1][0].startswith("PermissionError: shared segment ubep-")
    for rank, (outcome, left) in enumerate(results):
        if rank != 1:  # a peer's segment vanished (rank 1's, or that of a rank it made fail), or a deadline
            assert outcome.split(":")[0] in ("CommTimeoutError", "PeerAbortedError"), outcome
            assert outcome.split(": ")[1].startswith("Buffer construction"), outcome
        assert left == [], (rank, left)

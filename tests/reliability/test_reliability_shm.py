"""Reliability of the shared-memory transport where hosts differ from a laptop:
a small /dev/shm (Docker's 64 MiB, in a mount namespace), jobs in separate PID
namespaces sharing /dev/shm, another user squatting doorbells, and ranks killed
at each step of construction. Namespace tests need root (`unshare`); they skip
with the reason where it is refused."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
from faultcase import group_pids
from repo import SRC, SUPPORT

import ubep
import ubep.transport.segments
from ubep.engine import choose_engine
from ubep.errors import SharedMemorySizeError
from ubep.sizing import size_hint
from ubep.transport import segments

HERE = os.path.dirname(os.path.abspath(__file__))  # a child imports this module by name
NOBODY = 65534


def _can(*args: str) -> str | None:
    """None if `unshare args true` works here, else why not."""
    try:
        done = subprocess.run(["unshare", *args, "true"], capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"unshare unavailable: {error}"
    return None if done.returncode == 0 else f"unshare {' '.join(args)} refused: {done.stderr.decode()[:80]}"


def _skip_unless(*args: str):
    why = _can(*args)
    return pytest.mark.skipif(why is not None, reason=why or "")


def ours() -> set[str]:
    return {n for n in os.listdir(segments.SHM_DIR) if n.startswith(segments.NAME_PREFIX)}


def residue(pids: set[int]) -> list[str]:
    """Our segments in /dev/shm created by any of `pids`."""
    return [n for n in os.listdir(segments.SHM_DIR) if segments.segment_pid(n) in pids]


def _python(script: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(script)]


ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, [SRC, HERE, SUPPORT])))


# -- a small /dev/shm -------------------------------------------------------------------------------

SMALL_SHM_ARGS = dict(hidden=7168, num_experts=16, max_tokens_per_rank=128, max_topk=8)


def build_on_small_shm(low_latency: bool):
    """One rank: build, and run a call that touches every page a call touches; or the refusal."""
    try:
        with ubep.Buffer(**SMALL_SHM_ARGS, low_latency=low_latency, timeout_s=20) as buf:
            x = torch.randn(128, 7168).bfloat16()
            idx = torch.stack([torch.randperm(16)[:8] for _ in range(128)])
            got = buf.dispatch(x, topk_idx=idx, topk_weights=torch.rand(128, 8))
            buf.combine(got.recv_x, got.handle)  # no SIGBUS on a size that fits
            return "built"
    except SharedMemorySizeError as error:
        return [error.needed, error.free, str(error)]


def small_shm_job() -> None:
    """Run inside the mount namespace: print the sizes, then each build's results."""
    big = size_hint(**SMALL_SHM_ARGS, num_ranks=2, low_latency=True)
    small = size_hint(**SMALL_SHM_ARGS, num_ranks=2)
    print("SIZES", big.host_touchable_bytes, small.host_touchable_bytes, flush=True)
    for low_latency in (True, False):
        results = ubep.LocalLaunch(world_size=2, timeout_s=120).run(build_on_small_shm, low_latency)
        print("RESULT", json.dumps(results), flush=True)


@pytest.mark.timeout(240)
@_skip_unless("-m")
def test_small_dev_shm_refuses_on_every_rank_with_the_sizes_and_the_argument():
    mount = 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$0" "$@"'
    job = _python("import test_reliability_shm as t; t.small_shm_job()")
    cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", mount, *job]
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.split(" ", 1) for line in done.stdout.splitlines() if line.startswith(("SIZES", "RESULT"))]
    big, small = (int(v) for v in lines[0][1].split())
    assert small < 64 * 2**20 < big, "the test's sizes must straddle the 64 MiB /dev/shm"
    refused, fitted = json.loads(lines[1][1]), json.loads(lines[2][1])
    for needed, free, message in refused:  # every rank raised, before allocating anything
        assert needed == big and free <= 64 * 2**20, message
        assert f"need {big} bytes" in message and "/dev/shm has" in message
        assert "lower max_tokens_per_rank" in message and "without low_latency=True" in message
    assert fitted == ["built", "built"]


def absurd() -> str:
    try:
        ubep.Buffer(hidden=1 << 20, num_experts=8, max_tokens_per_rank=1 << 14, timeout_s=20)
    except SharedMemorySizeError as error:
        return str(error)
    return "built"


@pytest.mark.timeout(120)
def test_absurd_size_is_a_clear_error_not_an_oserror():
    before = ours()
    for message in ubep.LocalLaunch(world_size=2, timeout_s=100).run(absurd):
        assert message.startswith("Buffer construction: the shared segments need"), message
    assert ours() <= before


# -- PID namespaces sharing /dev/shm --------------------------------------------------------------

CREATOR = """
    import os, sys
    from ubep.transport.segments import _create, segment_name
    name = segment_name(os.getpid())
    segment = _create(name, 4096)
    print(name, flush=True)
    sys.stdin.readline()
"""

CREATOR_IN_NAMESPACE = """
    import subprocess, sys
    from ubep.transport.segments import sweep_stale_segments
    target = int(sys.argv[2])  # the creator's pid: free in a fresh namespace (see the test)
    while int(open("/proc/sys/kernel/ns_last_pid").read()) < target - 1:
        subprocess.run(["true"])
    creator = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    print(creator.stdout.readline().strip(), flush=True)
    sys.stdin.readline()
    creator.stdin.close()
    creator.wait()
    print(sweep_stale_segments(), flush=True)  # in its own namespace, a dead creator's segment goes
"""

SWEEPER = """
    from ubep.transport.segments import sweep_stale_segments
    print(sweep_stale_segments(), flush=True)
"""


@pytest.mark.timeout(120)
@_skip_unless("-p", "-f", "--mount-proc")
def test_jobs_in_other_pid_namespaces_do_not_sweep_each_others_live_segments():
    ns = ["unshare", "-p", "-f", "--mount-proc"]
    # A pid a fresh python in another namespace does not hold (its threads take 2, 3, ...), and that
    # is alive on the host, so that jobs running an older sweep on this host leave the segment alone.
    target = next(p for p in range(12, 4096) if os.path.exists(f"/proc/{p}"))
    job = subprocess.Popen(
        [*ns, *_python(CREATOR_IN_NAMESPACE), textwrap.dedent(CREATOR), str(target)],
        env=ENV,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    name = ""
    try:
        name = job.stdout.readline().strip()
        path = os.path.join(segments.SHM_DIR, name)
        assert name.startswith(segments.NAME_PREFIX) and os.path.exists(path), name
        other = subprocess.run([*ns, *_python(SWEEPER)], env=ENV, capture_output=True, text=True, timeout=60)
        assert other.returncode == 0, other.stderr[-2000:]
        assert name not in other.stdout and os.path.exists(path), "another namespace swept a live segment"
        assert name not in segments.sweep_stale_segments() and os.path.exists(path), "so did the host's"
        job.stdin.write("done\n")
        job.stdin.flush()
        assert name in job.stdout.readline() and not os.path.exists(path), "its own namespace may sweep it"
    finally:
        job.kill()
        job.wait()
        if name and os.path.exists(os.path.join(segments.SHM_DIR, name)):
            os.unlink(os.path.join(segments.SHM_DIR, name))


def cycles(n: int) -> int:
    for _ in range(n):
        ubep.Buffer(hidden=16, num_experts=4, max_tokens_per_rank=8, timeout_s=20).close()
    return n


CYCLES = """
    import test_reliability_shm as t, ubep
    print(ubep.LocalLaunch(world_size=2, timeout_s=200).run(t.cycles, 10), flush=True)
"""


@pytest.mark.timeout(300)
@_skip_unless("-p", "-f", "--mount-proc")
def test_two_jobs_in_pid_namespaces_construct_side_by_side():
    ns = ["unshare", "-p", "-f", "--mount-proc"]
    jobs = [
        subprocess.Popen(
            [*ns, *_python(CYCLES)], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    for job in jobs:
        out, err = job.communicate(timeout=280)
        assert job.returncode == 0 and "[10, 10]" in out, err[-2000:]


# -- doorbells another process (another user, where root) tries to squat --------------------------

SQUATTER = """
    import os, socket, sys
    if os.getuid() == 0:
        os.setgid(NOBODY); os.setuid(NOBODY)
    held = []
    for address in sys.argv[1:]:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.bind(address.encode().replace(b"@", b"\\0", 1))
        held.append(s)
    print("bound", os.getuid(), flush=True)
    sys.stdin.readline()
""".replace("NOBODY", str(NOBODY))


def squatted_construction() -> str:
    """The moment each rank's segment name appears in /dev/shm, a squatter (as nobody where
    root) binds every doorbell address an outsider could derive from that name."""
    real = segments._create
    squatters = []

    def create_and_get_squatted(name: str, nbytes: int):
        segment = real(name, nbytes)
        guesses = sorted({"@" + name, "@" + ubep.doorbell.address(name)[1:]})
        squatter = subprocess.Popen(
            _python(SQUATTER) + guesses, env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert squatter.stdout.readline().startswith("bound")
        squatters.append(squatter)
        return segment

    segments._create = create_and_get_squatted
    try:
        with ubep.Buffer(hidden=16, num_experts=4, max_tokens_per_rank=8, timeout_s=20) as buf:
            x, idx = torch.randn(4, 16), torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]])
            got = buf.dispatch(x, topk_idx=idx, topk_weights=idx.float())
            buf.combine(got.recv_x, got.handle)
        return "built"
    finally:
        segments._create = real
        for squatter in squatters:
            squatter.kill()
            squatter.wait()


@pytest.mark.timeout(120)
def test_doorbells_survive_a_squatter_who_reads_dev_shm():
    assert ubep.LocalLaunch(world_size=2, timeout_s=100).run(squatted_construction) == ["built", "built"]


def test_a_squatted_doorbell_address_is_a_clear_error():
    import socket

    from ubep.doorbell import Doorbell, address
    from ubep.errors import DoorbellInUseError

    key = os.urandom(32)
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    squatter.bind(address("ubep-1-2-3-abc", key))
    try:
        with pytest.raises(DoorbellInUseError, match="already holds this rank's doorbell address"):
            Doorbell("ubep-1-2-3-abc", key)
        Doorbell("ubep-1-2-3-abc", os.urandom(32)).close()  # another job's key: another address
    finally:
        squatter.close()


# -- ranks killed during construction ----------------------------------------------------------------


KILLED_DEADLINE_S = 30.0  # long: the survivors must see the death, not this deadline


def killed_in_construction(step: int) -> tuple[str, float, list[str]]:
    """Rank 2 kills itself at construction step `step` (1-3: just before the heap's k-th
    all-gather; 4: after the last one, before unlinking). Survivors report (error, seconds, residue)."""
    pids = group_pids()
    if dist.get_rank() == 2:
        if step <= 3:
            real_gather, calls = segments._gather, []

            def gather(group, world_size, mine):
                calls.append(1)
                if len(calls) == step:
                    os.kill(os.getpid(), signal.SIGKILL)
                return real_gather(group, world_size, mine)

            segments._gather = gather
        else:
            segments._unlink = lambda name: os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        ubep.Buffer(hidden=16, num_experts=6, max_tokens_per_rank=8, timeout_s=KILLED_DEADLINE_S).close()
        outcome = "built"
    except ubep.UbepError as error:
        outcome = f"{type(error).__name__}: {error}"
    return outcome, time.monotonic() - start, residue(pids)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("step", [1, 2, 3, 4])
def test_a_rank_killed_in_construction_is_named_and_leaves_no_name(step):
    outcomes = ubep.LocalLaunch(world_size=3, timeout_s=100).outcomes(killed_in_construction, step)
    assert not outcomes[2].ok
    for rank in (0, 1):
        assert outcomes[rank].ok, (rank, outcomes[rank].cause, outcomes[rank].error)
        error, elapsed, left = outcomes[rank].result
        assert left == [], (rank, left)
        assert error.startswith("CommTimeoutError"), error
        assert elapsed < KILLED_DEADLINE_S, (error, elapsed)  # seen dead, not at the deadline
        assert "rank(s) 2 died" in error and "Buffer construction" in error, error  # known from joining on
        assert "rank(s) 1 died" not in error and "rank(s) 0 died" not in error, error


def killed_at_a_random_moment(seed: int) -> tuple[str, list[str]]:
    """Rank 2 is SIGKILLed by a timer at a random moment of construction (0-150 ms in).
    Survivors report (outcome, residue), after waiting long enough to have seen the death."""
    import random
    import threading

    pids = group_pids()
    choose_engine("auto")  # loaded now, so that the moment falls among construction's collectives
    if dist.get_rank() == 2:
        delay = random.Random(seed).uniform(0.0, 0.15)
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
    try:
        buf = ubep.Buffer(hidden=16, num_experts=6, max_tokens_per_rank=8, timeout_s=2)
        time.sleep(0.5)  # rank 2 is dead by now whenever its timer fired
        buf.close()
        outcome = "built"
    except ubep.UbepError as error:
        outcome = f"{type(error).__name__}: {error}"
    return outcome, residue(pids)


@pytest.mark.timeout(200)
def test_kills_at_random_moments_of_construction_leave_nothing_and_blame_no_survivor():
    for seed in range(6):
        outcomes = ubep.LocalLaunch(world_size=3, timeout_s=60).outcomes(killed_at_a_random_moment, seed)
        for rank in (0, 1):
            assert outcomes[rank].ok, (seed, rank, outcomes[rank].error)
            outcome, left = outcomes[rank].result
            assert left == [], (seed, rank, left)
            named_dead = re.search(r"rank\(s\) ([\d, ]+) died", outcome)  # "... did not arrive": unsure
            assert named_dead is None or set(named_dead[1].split(", ")) == {"2"}, (seed, outcome)

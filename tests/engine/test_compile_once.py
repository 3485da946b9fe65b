"""The numba kernels compile once per host (`ubep.engine.compile_once`), not once per rank.

Four rank processes of `ubep.LocalLaunch` build a Buffer on an empty NUMBA_CACHE_DIR at
once; each reports, per compiled function, how many signatures it compiled itself
(numba's cache misses, `kernel_stats`). Without the lock every rank compiles every
function; with it one rank compiles them and the other three load them from the cache.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("numba")

HERE = os.path.dirname(os.path.abspath(__file__))
RANKS = 4


def rank_report() -> tuple[dict[str, list[int]], str]:
    """(per function: [compiled here, loaded], explain()) of one rank, after building its Buffer."""
    import ubep
    from ubep.engine.compile_once import kernel_stats

    with ubep.Buffer(hidden=8, num_experts=4, max_tokens_per_rank=2, engine="numba", timeout_s=200) as buf:
        return kernel_stats(), buf.explain()


def launch() -> None:
    """Every rank's report, as JSON on stdout (run in a fresh interpreter: see the test)."""
    import ubep

    print(json.dumps(ubep.LocalLaunch(world_size=RANKS, timeout_s=240).run(rank_report)))


def _python(code: str, env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )


def test_four_ranks_on_an_empty_cache_compile_each_function_once(tmp_path):
    # A fresh interpreter: numba reads NUMBA_CACHE_DIR when it is imported, and LocalLaunch's ranks
    # come from a forkserver that keeps the environment it started with.
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "UBEP_LOG_LEVEL": "INFO"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, env.get("PYTHONPATH", "")) if p)
    done = _python("import test_compile_once as t; t.launch()", env, timeout_s=280)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = json.loads(done.stdout.strip().splitlines()[-1])
    compiled_by = {}
    for rank, (stats, _) in enumerate(reports):
        for name, (compiled, _) in stats.items():
            if compiled:
                compiled_by.setdefault(name, []).append(rank)
    assert compiled_by, "no rank compiled anything: the cache was not empty"
    twice = {name: ranks for name, ranks in compiled_by.items() if len(ranks) > 1}
    assert not twice, f"functions compiled by more than one process: {twice}"
    compilers = {rank for ranks in compiled_by.values() for rank in ranks}
    assert len(compilers) == 1, f"ranks {sorted(compilers)} each compiled some functions"
    for rank, (_, explain) in enumerate(reports):
        expected = "compiled in this process" if rank in compilers else "loaded from the cache"
        assert expected in explain, explain
    assert "compiling ubep's numba kernels" in done.stderr  # the one INFO line while it compiles


def test_a_wait_past_the_deadline_names_the_compiling_process(tmp_path):
    from ubep.engine import compile_once
    from ubep.errors import CompileWaitTimeoutError

    with open(tmp_path / compile_once.LOCK_FILE, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("4242")
        held.flush()
        start = time.monotonic()
        with pytest.raises(CompileWaitTimeoutError, match=r"pid 4242.*ubep warm"):
            with compile_once._host_lock(str(tmp_path), deadline=start + 0.3):
                pass
        assert time.monotonic() - start < 5
    with compile_once._host_lock(str(tmp_path), deadline=time.monotonic() + 5):  # released: taken at once
        pass


def test_warm_behind_a_stopped_holder_names_it_and_gives_up(tmp_path):
    """`ubep warm` behind a lock holder with no heartbeat (stopped, or hung): a line naming the pid it
    waits for, then one line giving up at its --timeout (issue 45, item 13: it waited for ever, silently)."""
    from ubep.engine import compile_once

    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    env.pop("UBEP_LOG_LEVEL", None)
    code = "from ubep.engine.compile_once import cache_location; print(cache_location().path)"
    where = _python(code, env, timeout_s=120).stdout.strip().splitlines()[-1]
    os.makedirs(where, exist_ok=True)
    with open(os.path.join(where, compile_once.LOCK_FILE), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("4242")
        held.flush()
        start = time.monotonic()
        warm = "from ubep.cli import main; raise SystemExit(main(['warm', '--timeout', '3']))"
        done = _python(warm, env, timeout_s=120)
        took = time.monotonic() - start
    assert done.returncode == 1, (done.returncode, done.stderr[-3000:])
    assert "ubep warm: waiting for another process (pid 4242)" in done.stderr, done.stderr[-3000:]
    assert "ubep warm: gave up after" in done.stderr and "pid 4242 holds the compile lock" in done.stderr
    assert took < 60, took


def test_a_holder_that_shows_progress_is_waited_for_past_the_deadline(tmp_path, monkeypatch):
    """A slow compile (the holder's heartbeat goes on) is no stall: the waiter waits it out."""
    import threading

    from ubep.engine import compile_once

    monkeypatch.setattr(compile_once, "HEARTBEAT_S", 0.05)
    holding, done = threading.Event(), threading.Event()

    def hold() -> None:
        with compile_once._host_lock(str(tmp_path), deadline=None):
            holding.set()
            done.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    holding.wait(10)
    threading.Timer(1.0, done.set).start()  # a compile of 1 s, against a deadline of 0.3 s
    start = time.monotonic()
    with compile_once._host_lock(str(tmp_path), deadline=start + 0.3):
        waited = time.monotonic() - start
    holder.join(10)
    assert waited >= 0.9, waited


def test_an_unwritable_cache_directory_falls_back_and_says_so(tmp_path):
    blocked = tmp_path / "a_file"
    blocked.write_text("not a directory")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(blocked / "cache")}  # cannot be created, even by root
    code = "from ubep.engine.compile_once import cache_location; print(cache_location().note)"
    done = _python(code, env, timeout_s=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"NUMBA_CACHE_DIR={blocked / 'cache'} is not writable: using" in done.stdout

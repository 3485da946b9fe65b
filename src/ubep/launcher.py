"""Start N rank processes on this host with torch.distributed (gloo) initialised.

For tests, benchmarks and users without torchrun: `LocalLaunch(world_size=8).run(fn, *args)`
calls `fn(*args)` on every rank and returns the results in rank order. A rank
that raises has its traceback re-raised here with its rank named, and the other
ranks are killed; a deadline bounds the whole run. One rank runs inline.
`fn` and `args` travel to the ranks by pickling, a function by its module and
name: `fn` must be defined at the top level of an importable module (not a
lambda, a nested function, or a function typed into a REPL, a notebook or
`python -c`). Anything else is refused before a rank starts, saying so.

Each rank sees torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, GROUP_RANK), so `ranks_per_node` can emulate several nodes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ubep.engine import NUMBA_PRELOAD
from ubep.transport.segments import sweep_stale_segments


class RankFailedError(RuntimeError):
    """A rank raised, died or missed the deadline; the message carries its traceback."""

    def __init__(self, rank: int | None, message: str):
        self.rank = rank
        super().__init__(message)


@dataclass(frozen=True, slots=True)
class RankOutcome:
    """How one rank ended: a result, an error (its traceback), or an exit without either."""

    rank: int
    ok: bool
    result: Any = None
    error: str | None = None  # traceback text, or why the rank produced nothing
    exit_code: int | None = None
    cause: str = "ok"  # "ok", "raised", "died", "deadline", or "stopped" (killed after another failed)


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalLaunch:
    """Spawn `world_size` ranks on this host, each running one function."""

    world_size: int
    timeout_s: float = 300.0
    ranks_per_node: int | None = None  # emulated node size; None: one node
    threads_per_rank: int = 1  # torch intra-op threads in each rank
    start_method: str = "forkserver"  # see _context: plain fork is unsafe in a threaded parent

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Every rank's `fn(*args)`, in rank order; raises RankFailedError on any failure."""
        if self.world_size == 1:
            return [fn(*args)]
        outcomes = self._launch(fn, args, stop_on_error=True)
        failed = [o for o in outcomes if not o.ok]
        if failed:
            first = min(failed, key=lambda o: (o.cause == "stopped", o.rank))
            raise RankFailedError(first.rank, f"rank {first.rank} failed:\n{first.error}")
        return [o.result for o in outcomes]

    def outcomes(self, fn: Callable[..., Any], *args: Any) -> list[RankOutcome]:
        """Every rank's outcome, failures included (for fault-injection tests)."""
        return self._launch(fn, args, stop_on_error=False)

    def _launch(self, fn, args, stop_on_error: bool) -> list[RankOutcome]:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        payload = _pickled(fn, args)
        ctx = _context(self.start_method)
        store = dist.TCPStore(
            "127.0.0.1", 0, None, True, timedelta(seconds=self.timeout_s), wait_for_workers=False
        )
        results: mp.Queue = ctx.Queue()
        procs = [
            ctx.Process(target=_rank_main, args=(self, rank, store.port, payload, results), daemon=True)
            for rank in range(self.world_size)
        ]
        try:
            for p in procs:
                p.start()
            return self._collect(procs, results, stop_on_error)
        finally:
            started = [p for p in procs if p.pid is not None]
            for p in started:
                p.kill()  # a rank that exited since is skipped (os.kill would race with its exit)
            for p in started:
                p.join(timeout=10)
            sweep_stale_segments({p.pid for p in started})
            del store

    def _collect(self, procs, results: mp.Queue, stop_on_error: bool) -> list[RankOutcome]:
        deadline = time.monotonic() + self.timeout_s
        done: dict[int, RankOutcome] = {}
        while len(done) < len(procs):
            try:
                outcome = results.get(timeout=0.05)
                done[outcome.rank] = outcome
                if stop_on_error and not outcome.ok:
                    break
                continue
            except queue.Empty:
                pass
            exited = [r for r, p in enumerate(procs) if r not in done and p.exitcode is not None]
            if exited:
                _drain(results, done)  # a rank may exit right after reporting
            for rank in exited:
                if rank not in done:
                    code = procs[rank].exitcode
                    done[rank] = RankOutcome(
                        rank,
                        False,
                        error=f"exited with code {code} and no result",
                        exit_code=code,
                        cause="died",
                    )
            if stop_on_error and any(not o.ok for o in done.values()):
                break
            if time.monotonic() > deadline:
                missing = sorted(set(range(len(procs))) - set(done))
                for rank in missing:
                    done[rank] = RankOutcome(
                        rank, False, error=f"still running after {self.timeout_s:g} s", cause="deadline"
                    )
                if stop_on_error:
                    raise RankFailedError(
                        missing[0], f"rank(s) {missing} still running after {self.timeout_s:g} s"
                    )
        for rank in range(len(procs)):
            done.setdefault(
                rank, RankOutcome(rank, False, error="stopped after another rank failed", cause="stopped")
            )
        return [done[r] for r in range(len(procs))]


def _pickled(fn: Callable[..., Any], args: tuple) -> bytes:
    """(fn, args) as the ranks will receive them; TypeError saying why and what to do where they cannot."""
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        payload = bytes(ForkingPickler.dumps((fn, args)))
    except Exception as err:  # pickle raises PicklingError, AttributeError or TypeError, by object
        raise TypeError(
            f"LocalLaunch cannot send {name} and its arguments to the rank processes, which receive "
            f"them by pickling ({type(err).__name__}: {err}). Pass a function defined at the top level "
            "of a module (not a lambda, nor one defined inside another function), and picklable "
            "arguments after it: run(fn, *args)."
        ) from err
    if getattr(fn, "__module__", None) == "__main__" and not hasattr(sys.modules["__main__"], "__file__"):
        raise TypeError(
            f"LocalLaunch cannot run {name}: it is defined in an interactive session (a REPL, a notebook "
            "or python -c), which the rank processes cannot import; they receive a function by its "
            "module and name. Put it in a .py file and import it from there, or run a script."
        )
    return payload


def _context(start_method: str):
    """The multiprocessing context; a fork server preloads torch and numba so each rank starts fast
    (`ubep.engine.NUMBA_PRELOAD`: where numba is missing the server skips it).

    Forking the caller directly would copy a process that runs threads (torch's
    thread pools, the rendezvous store's server): a lock held by one of them at
    fork time stays locked forever in the child. The fork server is a clean,
    single-threaded process that imported torch once.
    """
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed", "ubep", *NUMBA_PRELOAD])
    return ctx


def _drain(results: mp.Queue, done: dict[int, RankOutcome]) -> None:
    """Take every result still in the pipe."""
    while True:
        try:
            outcome = results.get(timeout=0.05)
        except queue.Empty:
            return
        done[outcome.rank] = outcome


UNLOADABLE = (
    "The rank could not load the function or its arguments sent by LocalLaunch: each must be "
    "importable here by its module and name (defined at the top level of a module this process can "
    "import, not in a REPL, a notebook or python -c)."
)


def _rank_main(launch: LocalLaunch, rank: int, port: int, payload: bytes, results: mp.Queue) -> None:
    per_node = launch.ranks_per_node or launch.world_size
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(launch.world_size),
        LOCAL_RANK=str(rank % per_node),
        LOCAL_WORLD_SIZE=str(per_node),
        GROUP_RANK=str(rank // per_node),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(launch.threads_per_rank)
    try:
        fn, args = pickle.loads(payload)
    except BaseException:
        _report(results, RankOutcome(rank, False, error=traceback.format_exc() + UNLOADABLE, cause="raised"))
    try:
        timeout = timedelta(seconds=launch.timeout_s)
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=launch.world_size, timeout=timeout)
        dist.barrier()  # every rank connected before any may exit: a rank done first would cut a peer's mesh
        outcome = RankOutcome(rank, True, result=fn(*args))
    except BaseException:
        outcome = RankOutcome(rank, False, error=traceback.format_exc(), cause="raised")
    _report(results, outcome)


def _report(results: mp.Queue, outcome: RankOutcome) -> NoReturn:
    """Hand the outcome to the launcher and exit."""
    results.put(outcome)
    results.close()
    results.join_thread()
    os._exit(0)  # skip process-group teardown, which waits on peers that may be gone

"""Deadlines for torch.distributed collectives, and errors that name the peers.

Shared-memory waits keep their own deadline (`ubep.waiting`); collectives wait
inside the backend, which keeps the process group's timeout (30 minutes by
default). `collective_deadline` sets the gloo backend's timeout to the
Buffer's `timeout_s` for the duration of ubep's own collectives, restores it
afterwards, and turns a backend failure into `CommTimeoutError`.

What a backend failure can tell: gloo reports a dead peer at once ("connection
reset") and a silent one at the deadline, but by socket address, not by rank.
Where peers run on this host, their pids (see `PeerPids`) say which died; a
stall between hosts can only be reported as "one of these ranks".

NCCL groups (CUDA) keep their own timeout: not changed here.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ubep.errors import CommTimeoutError, UbepError
from ubep.waiting import process_alive

DEATH_GRACE_S = 0.5  # how long a failed collective looks for a dead local peer


@dataclass(frozen=True, slots=True)
class PeerPids:
    """Each rank's pid where it runs on this host (None elsewhere), for liveness checks."""

    rank: int
    pids: tuple[int | None, ...]

    @classmethod
    def gather(cls, group: dist.ProcessGroup, rank: int, world_size: int) -> PeerPids:
        """Collective: every rank learns which peers share its host, and their pids."""
        everyone: list[tuple[str, int]] = [("", 0)] * world_size
        dist.all_gather_object(everyone, (socket.gethostname(), os.getpid()), group=group)
        host = socket.gethostname()
        return cls(rank, tuple(pid if h == host else None for h, pid in everyone))

    def dead(self) -> list[int]:
        return [r for r, pid in enumerate(self.pids) if pid is not None and not process_alive(pid)]

    def dead_after_grace(self) -> list[int]:
        """Dead peers, looking again for a moment: a killed peer's sockets close (and
        gloo reports it) a little before its process shows as exited."""
        deadline = time.monotonic() + DEATH_GRACE_S
        while not (dead := self.dead()) and time.monotonic() < deadline:
            time.sleep(0.02)
        return dead


def _gloo(group: dist.ProcessGroup | None):
    """The group's gloo backend, or None (no group, or not gloo)."""
    if group is None or not hasattr(dist, "ProcessGroupGloo"):
        return None
    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError:
        return None
    return backend if isinstance(backend, dist.ProcessGroupGloo) else None


def _from_backend(error: BaseException) -> bool:
    """Whether `error` is a failure reported by the collective backend (not ours, not a bug)."""
    if isinstance(error, UbepError):
        return False
    return type(error) is RuntimeError or isinstance(error, dist.DistError)


@contextmanager
def collective_deadline(
    group: dist.ProcessGroup | None,
    timeout_s: float,
    phase: str,
    peers: PeerPids | None = None,
    names: tuple[int, ...] | None = None,
) -> Iterator[None]:
    """Run the block's collectives under a `timeout_s` deadline; name the peers if one fails.

    `names[i]` is how errors name the group's rank i (default: i), e.g. its rank in
    the EP group when `group` is a subgroup of it.
    """
    backend = _gloo(group)
    previous = backend.options._timeout if backend is not None else None
    if backend is not None:
        backend._set_default_timeout(timedelta(seconds=timeout_s))
    try:
        yield
    except BaseException as error:
        if not _from_backend(error):
            raise
        raise _timeout_error(group, timeout_s, phase, peers, error, names) from error
    finally:
        if backend is not None:
            backend._set_default_timeout(previous)


def _timeout_error(
    group, timeout_s: float, phase: str, peers: PeerPids | None, error, names: tuple[int, ...] | None
) -> CommTimeoutError:
    said = str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__
    me = peers.rank if peers is not None else (dist.get_rank(group) if group is not None else 0)
    world = dist.get_world_size(group) if group is not None else 1
    timed_out = "timed out" in said.lower()  # a deadline, not a broken connection: no grace
    dead = [] if peers is None else peers.dead() if timed_out else peers.dead_after_grace()
    named = names or tuple(range(world))
    if dead:
        dead = [named[r] for r in dead]
        return CommTimeoutError(phase, dead, timeout_s, dead, f"torch.distributed: {said}")
    others = [named[r] for r in range(world) if r != me]
    detail = f"torch.distributed does not say which of them; it reported: {said}"
    return CommTimeoutError(phase, others, timeout_s, [], detail)

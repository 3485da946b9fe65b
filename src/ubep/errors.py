"""Exceptions raised by ubep.

Every failure a user can hit names what went wrong and where: the argument and
rule for bad input, the peers and the phase for a stalled exchange.
"""

from __future__ import annotations


class UbepError(RuntimeError):
    """Base class for ubep's runtime failures (not for bad arguments)."""


class CommTimeoutError(UbepError, TimeoutError):
    """A wait passed its deadline; `peers` lists the ranks that never signalled.

    `dead_peers` lists those among them whose process is known to have exited,
    which is detected before the deadline where the peer runs on this host. `lost`:
    the connection broke before the deadline, and which of `peers` left is unknown.
    `closed`: those of `dead_peers` known only by their connection's end (a fabric
    engine lost it), whose process may still run: they died or closed their Buffer.
    """

    def __init__(
        self,
        phase: str,
        peers: list[int],
        timeout_s: float,
        dead_peers: list[int],
        detail: str = "",
        *,
        lost: bool = False,
        closed: list[int] | None = None,
    ):
        self.phase = phase
        self.peers = list(peers)
        self.timeout_s = timeout_s
        self.dead_peers = list(dead_peers)
        self.lost = lost
        self.closed_peers = [p for p in closed or () if p in dead_peers]
        if dead_peers:
            seen = f"seen before the {timeout_s:g} s deadline"
            exited = [p for p in dead_peers if p not in self.closed_peers]
            said = [f"rank(s) {_ranks(exited)} died (process exited; {seen})"] if exited else []
            if self.closed_peers:
                ranks = _ranks(self.closed_peers)
                said.append(f"rank(s) {ranks} died or closed its Buffer (its connection closed; {seen})")
            why = "; ".join(said)
            alive = [p for p in peers if p not in dead_peers]
            if alive:
                why += f"; no signal from rank(s) {_ranks(alive)} either"
        elif lost:
            why = f"rank(s) {_ranks(peers)} did not arrive; one of them may have died"
        else:
            why = f"no signal from rank(s) {_ranks(peers)} after {timeout_s:g} s"
        super().__init__(f"{phase}: {why}" + (f" ({detail})" if detail else ""))


class CompileWaitTimeoutError(UbepError, TimeoutError):
    """A wait for another process's compile of the kernels passed its deadline while that process
    showed no progress: `holder` is its pid (as it wrote it in the lock file), `lock` the file,
    `waited_s` how long this process waited."""

    def __init__(self, message: str, holder: str = "?", lock: str = "", waited_s: float = 0.0):
        self.holder, self.lock, self.waited_s = holder, lock, waited_s
        super().__init__(message)


class CorruptCacheError(UbepError):
    """A file of numba's kernel cache could not be read, and removing it to compile again did not
    help (it could not be removed, or the fresh one failed too); `path` names it."""

    def __init__(self, message: str, path: str):
        self.path = path
        super().__init__(message)


class ConfigMismatchError(UbepError):
    """Ranks constructed a Buffer with different settings."""


class PeerDataError(UbepError):
    """A peer published a value that fails the receiver's bounds checks; `culprit` is that peer where
    one rank is to blame (None: the ranks' calls differ, or the writer is not known), passed on to the
    other peers when this rank gives up on the call."""

    def __init__(self, message: str, culprit: int | None = None):
        super().__init__(message)
        self.culprit = culprit


class MaskedOutError(UbepError):
    """The other ranks masked this one out of the group (they saw it die or go silent): it must not
    touch their memory again, and takes part in no further call."""


class PartitionError(UbepError):
    """This rank's side of a split group may not go on: the ranks it can still reach are no quorum of
    the ranks that were in (a strict majority, or on an exact half the side holding the lowest rank),
    so the other side may be the one that continues. `lost` are the ranks this side lost; the Buffer
    takes no further call (docs/reliability.md, "A split is not two worlds")."""

    def __init__(self, message: str, lost: list[int]):
        super().__init__(message)
        self.lost = sorted(lost)


class RejoinError(UbepError):
    """A process restarted in a masked rank's place could not join the running group: no record of
    it in the rendezvous store, no live rank holding its segments, a Buffer built otherwise, or the
    old process still running."""


class SharedMemorySizeError(ValueError):
    """A Buffer's shared segments do not fit this host's /dev/shm, its cgroup's memory limit or its
    available memory.

    Raised on every rank at construction, before any segment exists; `needed` and
    `free` are bytes for the whole host (every local rank's segment).
    """

    def __init__(self, message: str, needed: int, free: int):
        self.needed = needed
        self.free = free
        super().__init__(message)


class DoorbellInUseError(UbepError):
    """Another socket holds the abstract address this rank's doorbell derived from the job's secret."""


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in sorted(ranks))

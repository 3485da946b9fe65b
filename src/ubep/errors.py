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
    ):
        self.phase = phase
        self.peers = list(peers)
        self.timeout_s = timeout_s
        self.dead_peers = list(dead_peers)
        if dead_peers:
            ranks = _ranks(dead_peers)
            why = f"rank(s) {ranks} died (process exited; seen before the {timeout_s:g} s deadline)"
            alive = [p for p in peers if p not in dead_peers]
            if alive:
                why += f"; no signal from rank(s) {_ranks(alive)} either"
        elif lost:
            why = f"rank(s) {_ranks(peers)} did not arrive; one of them may have died"
        else:
            why = f"no signal from rank(s) {_ranks(peers)} after {timeout_s:g} s"
        super().__init__(f"{phase}: {why}" + (f" ({detail})" if detail else ""))


class CompileWaitTimeoutError(UbepError, TimeoutError):
    """A Buffer's construction deadline passed while another process compiled the kernels."""


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

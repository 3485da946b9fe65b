"""Doorbells: how a waiting rank sleeps in the kernel until a peer has news.

Polling shared memory is fast while cores are free, but with more ranks than
cores a poller steals the time its peers need to produce the data. So after a
short yield phase a waiter blocks on its doorbell, a Unix datagram socket in
the abstract namespace (no file, nothing to clean up), and a writer rings the
doorbells of the ranks that may be waiting for the stamp it just wrote.

A ring carries no data and may be lost or spurious: the waiter always
re-reads the stamps after waking, and never blocks longer than its liveness
period. Rings never block the ringer (a full queue already means "wake up").

Addresses: anyone on the host may bind any free abstract name, so a name an
outsider can predict (the segment name, readable in /dev/shm during
construction) could be taken first. Each address is instead an HMAC of the
segment name under `key`, a secret the job's ranks share through the process
group (`SymmetricHeap.doorbell_key`) and nobody else sees. A stranger can still
read bound addresses from /proc/net/unix and send a datagram: that is a
spurious ring, which costs a waiter one extra look at its stamps.
"""

from __future__ import annotations

import errno
import hmac
import select
import socket

from ubep.errors import DoorbellInUseError

ADDRESS_PREFIX = "ubep-bell-"


def address(name: str, key: bytes = b"") -> str:
    """The abstract-namespace address of the doorbell for segment `name` under `key`."""
    if not key:
        return "\0" + name  # no secret: the segment name itself (single-process uses and tests)
    return "\0" + ADDRESS_PREFIX + hmac.digest(key, name.encode(), "sha256")[:16].hex()


class Doorbell:
    """This rank's doorbell, and the addresses of its peers' doorbells.

    `key` (optional; default: none) is the job's secret the addresses derive from.
    """

    def __init__(self, name: str, key: bytes = b""):
        self._key = key
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.bind(address(name, key))
        except OSError as error:
            self._sock.close()
            if error.errno != errno.EADDRINUSE:
                raise
            why = "it derives from the job's secret" if key else "it is the segment name, readable by others"
            raise DoorbellInUseError(
                f"Buffer construction: another socket already holds this rank's doorbell address "
                f"{address(name, key)[1:]!r} ({why})"
            ) from None
        self._sock.setblocking(False)
        self._peers: list[str] = []

    def connect(self, peer_names: list[str]) -> None:
        self._peers = [address(n, self._key) for n in peer_names]

    def ring(self, peer: int) -> None:
        """Wake `peer` if it is blocked; never blocks, never fails."""
        try:
            self._sock.sendto(b"\1", self._peers[peer])
        except OSError:
            pass  # queue full (it will wake anyway) or peer gone (its waiter reports that)

    def ring_all(self, me: int) -> None:
        for peer in range(len(self._peers)):
            if peer != me:
                self.ring(peer)

    def wait(self, timeout_s: float) -> None:
        """Block until rung or `timeout_s` passes; then swallow every queued ring."""
        ready, _, _ = select.select([self._sock], [], [], max(timeout_s, 0.0))
        while ready:
            try:
                self._sock.recv(64)
            except BlockingIOError:
                return

    def close(self) -> None:
        self._sock.close()

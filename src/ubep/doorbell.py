"""Doorbells: how a waiting rank sleeps in the kernel until a peer has news.

Polling shared memory is fast while cores are free, but with more ranks than
cores a poller steals the time its peers need to produce the data. So after a
short yield phase a waiter blocks on its doorbell, a Unix datagram socket in
the abstract namespace (no file, nothing to clean up), and a writer rings the
doorbells of the ranks that may be waiting for the stamp it just wrote.

A ring carries no data and may be lost or spurious: the waiter always
re-reads the stamps after waking, and never blocks longer than its liveness
period. Rings never block the ringer (a full queue already means "wake up").
"""

from __future__ import annotations

import select
import socket


def _address(name: str) -> str:
    return "\0" + name  # abstract namespace: gone when the socket closes


class Doorbell:
    """This rank's doorbell, and the addresses of its peers' doorbells."""

    def __init__(self, name: str):
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(_address(name))
        self._sock.setblocking(False)
        self._peers: list[str] = []

    def connect(self, peer_names: list[str]) -> None:
        self._peers = [_address(n) for n in peer_names]

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

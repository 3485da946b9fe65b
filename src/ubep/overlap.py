"""EventOverlap: the handle for work that may still be in flight (DeepEP's name).

On CPU, a call either completed before returning (the event is already done)
or holds the receive half of the protocol, which `wait()` runs exactly once.
"""

from __future__ import annotations

from collections.abc import Callable


class EventOverlap:
    """Completes pending work on `wait()`; also usable as `with event: ...`."""

    __slots__ = ("_pending",)

    def __init__(self, pending: Callable[[], None] | None = None):
        self._pending = pending

    @property
    def done(self) -> bool:
        return self._pending is None

    def wait(self) -> None:
        """Run the pending half, if any; later calls return at once."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending()

    def current_stream_wait(self) -> None:
        """DeepEP's spelling of `wait()`: make the caller's stream wait for the work."""
        self.wait()

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc) -> None:
        self.wait()


def _no_hook() -> None:
    """The hook of a call that already received."""


def receive_later(
    receive: Callable[[], None], async_finish: bool, return_recv_hook: bool
) -> tuple[EventOverlap, Callable[[], None]]:
    """(event, hook) for a call's receive half: run it now, or hand it to the event and/or the hook
    (DeepEP's `async_finish` and `return_recv_hook`)."""
    pending = EventOverlap(receive)
    if not (async_finish or return_recv_hook):
        pending.wait()
        return pending, _no_hook
    return (pending if async_finish else EventOverlap()), (pending.wait if return_recv_hook else _no_hook)

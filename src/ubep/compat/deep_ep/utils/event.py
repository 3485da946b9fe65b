"""DeepEP's `deep_ep.utils.event`: `EventHandle` and `EventOverlap` over ubep's pending receive halves.

DeepEP's event is a CUDA event; the wrapper adds `extra_tensors` (tensors kept
alive until the wait, its stand-in for `record_stream`), a hook run after the
wait (`register_hook_after_wait`) and `release_handle` (drop the event once
waited for, also as `with event(release_handle=True):`). Here the "event" is
the receive half of an asynchronous call, or nothing when the call already
finished, so waiting on it runs that half once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ubep.overlap import EventOverlap as _Pending


class EventHandle:
    """DeepEP's event: `EventHandle()` marks "everything issued so far", which on CPU is already done."""

    __slots__ = ("_pending",)

    def __init__(self, pending: _Pending | None = None):
        self._pending = pending

    def current_stream_wait(self) -> None:
        """Complete the work behind this event (once; later calls return at once)."""
        if self._pending is not None:
            self._pending.wait()


class EventOverlap:
    """DeepEP's `EventOverlap`: `.event` (an EventHandle, or None when the call finished synchronously)
    and `.extra_tensors`; `current_stream_wait()`, `wait()` or a `with` block completes the work.

    One difference from DeepEP 2.1: waiting on an event without `.event` (a synchronous call's) runs
    the hook and returns, where DeepEP asserts that an event exists.
    """

    def __init__(
        self, event: EventHandle | None = None, extra_tensors: tuple[torch.Tensor, ...] | None = None
    ):
        self.event = event
        self.extra_tensors = extra_tensors
        self.hook_after_wait: Callable[[], Any] | None = None
        self._release_handle_by_call = False  # set by `event(release_handle=...)` for the next `with`

    def current_stream_wait(self, release_handle: bool = False) -> Any:
        """Wait for the event, then run the registered hook (once); returns the hook's result, or None.
        With `release_handle`, drop the event afterwards (DeepEP frees what it holds that way)."""
        if self.event is not None:
            self.event.current_stream_wait()
        hook, self.hook_after_wait = self.hook_after_wait, None
        result = hook() if hook is not None else None
        if release_handle:
            self.event = None
        return result

    def wait(self) -> Any:
        """DeepEP V2's short form of `current_stream_wait()`."""
        return self.current_stream_wait()

    def register_hook_after_wait(self, hook_after_wait: Callable[[], Any]) -> None:
        """Run `hook_after_wait()` after the next wait, which returns its result (one hook at a time)."""
        if self.hook_after_wait is not None:
            raise RuntimeError("a hook is already registered on this EventOverlap")
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> EventOverlap:
        """`with event(release_handle=True):` releases the event when the block ends; returns self."""
        self._release_handle_by_call = release_handle
        return self

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.event is not None or self.hook_after_wait is not None:
            self.current_stream_wait(release_handle=self._release_handle_by_call)
        self._release_handle_by_call = False


def pending_event(pending: _Pending, async_finish: bool, keep: tuple | None = None) -> EventOverlap:
    """What a DeepEP call returns as its event: an EventHandle over the pending half when
    `async_finish`, else an empty EventOverlap (the call waited before returning)."""
    if not async_finish:
        pending.wait()
        return EventOverlap()
    return EventOverlap(EventHandle(pending), tuple(t for t in keep if t is not None) if keep else None)


def wait_previous(previous_event: EventOverlap | None) -> None:
    """DeepEP's `previous_event`: the call starts after it; run its pending half if it has one."""
    if previous_event is not None and getattr(previous_event, "event", None) is not None:
        previous_event.event.current_stream_wait()

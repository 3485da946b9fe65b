"""The memory-ordering primitives every Triton call half is made of (docs/device.md, "Memory ordering
on the GPU"): words at raw addresses of the heap's address table, system-scope acquire and release,
and the call's epoch read from a device word.

    protocol halves (each protocol's triton_halves) -> [these] -> memory (address table)

The same ideas as `ubep.engine.numba_sync` for the numba halves.
"""

from __future__ import annotations

import triton
import triton.language as tl

NEVER: tl.constexpr = tl.constexpr(-1)  # no polled word ever holds it: a CAS against it only reads


@triton.jit
def int64_ptr(address):
    """An int64 address (from the table) as a pointer to int64 words."""
    return address.to(tl.pointer_type(tl.int64))


@triton.jit
def load_acquire(address):
    """The int64 at `address`, read with a system-scope acquire (a compare-and-swap that never matches,
    so it never writes)."""
    never = tl.full((), NEVER, tl.int64)
    return tl.atomic_cas(int64_ptr(address), never, never, sem="acquire", scope="sys")


@triton.jit
def store_release(address, value):
    """Store `value` at `address` with a system-scope release: every store before it is visible first."""
    tl.atomic_xchg(int64_ptr(address), value, sem="release", scope="sys")


@triton.jit
def load_epoch(epochs):
    """(the call's epoch, its half: epoch % 2), read from the device word the host or a graph set."""
    epoch = tl.load(epochs)
    return epoch, epoch & 1

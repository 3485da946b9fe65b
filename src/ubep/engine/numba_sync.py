"""Synchronisation primitives for compiled call halves: ordered loads and stores on raw addresses,
a full fence, and the ways a waiting rank gives up its core.

Data as flag needs two orderings that plain compiled loads and stores do not
promise (LLVM may reorder them): a stamp is stored with *release* semantics, so
every payload byte written before it is visible to a reader that sees it; and it
is loaded with *acquire* semantics, so nothing read after it is older than it.
A sleeping rank's flag and a publisher's stamp form a Dekker pair (each stores
its word, then reads the other's), which needs a full fence between the store
and the load on both sides; see `ubep.protocols.combine.numba_halves` (`await_stamps`) for where it is used.

`yield_cpu` calls the C library's `sched_yield` by symbol name (the compiled
code stays cacheable on disk); `pause` is the spin-loop hint (x86 `pause`;
nothing elsewhere).
"""

from __future__ import annotations

import platform

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from ubep.engine.numba_kernels import _jit

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def _int64_at(builder, context, address, address_type):
    raw = context.cast(builder, address, address_type, types.intp)
    return builder.inttoptr(raw, ir.IntType(64).as_pointer())


@intrinsic
def load_acquire(typingctx, address):
    """The int64 at a raw address, loaded with acquire ordering."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        ptr = _int64_at(builder, context, args[0], signature.args[0])
        return builder.load_atomic(ptr, "acquire", 8)

    return types.int64(address), codegen


@intrinsic
def store_release(typingctx, address, value):
    """Store an int64 at a raw address with release ordering: everything stored before is visible first."""
    if not isinstance(address, types.Integer) or not isinstance(value, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        ptr = _int64_at(builder, context, args[0], signature.args[0])
        word = context.cast(builder, args[1], signature.args[1], types.int64)
        builder.store_atomic(word, ptr, "release", 8)
        return context.get_dummy_value()

    return types.none(address, value), codegen


@intrinsic
def load_relaxed(typingctx, address):
    """The int64 at a raw address (atomic, unordered: never torn, never kept in a register)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        ptr = _int64_at(builder, context, args[0], signature.args[0])
        return builder.load_atomic(ptr, "monotonic", 8)

    return types.int64(address), codegen


@intrinsic
def store_relaxed(typingctx, address, value):
    """Store an int64 at a raw address atomically, with no ordering."""
    if not isinstance(address, types.Integer) or not isinstance(value, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        ptr = _int64_at(builder, context, args[0], signature.args[0])
        word = context.cast(builder, args[1], signature.args[1], types.int64)
        builder.store_atomic(word, ptr, "monotonic", 8)
        return context.get_dummy_value()

    return types.none(address, value), codegen


@intrinsic
def full_fence(typingctx):
    """A sequentially consistent fence: no load after it is performed before a store ahead of it."""

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def yield_cpu(typingctx):
    """sched_yield(): let another runnable thread or process have this core."""

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield"
        )
        builder.call(fn, [])
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def pause(typingctx):
    """The spin-wait hint (x86 `pause`): a polling core backs off without leaving the thread."""

    def codegen(context, builder, signature, args):
        if _X86:  # LLVM's intrinsic for the instruction (numba's JIT takes no inline assembly)
            hint = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause"
            )
            builder.call(hint, [])
        return context.get_dummy_value()

    return types.none(), codegen


# What a rank's raised ASLEEP word says it sleeps for: a peer's stamp (data), or a peer's word that
# it consumed a buffer half (the reuse wait of low-latency mode). A stamp's writer rings a sleeper of
# either kind (`wake_if_asleep`, `wake_sleepers`); a rank that only consumed a half rings the reuse
# sleepers alone (`wake_reusers`), not every peer that sleeps for its data, which would wake, look,
# and sleep again.
ASLEEP_DATA, ASLEEP_REUSE = 1, 2


@_jit
def back_off(step, spins, yields, asleep, me, mark=ASLEEP_DATA):
    """Step `step` of a wait's budget: the spin hint for the first `spins` steps, then `yields`
    yields of the core, then one step that raises this rank's ASLEEP word to `mark` and fences (the
    last look before the half hands the wait to Python's doorbell sleep). False once the budget is
    spent."""
    if step < spins:
        pause()
    elif step < spins + yields:
        yield_cpu()
    elif step == spins + yields:
        store_relaxed(asleep[me], mark)
        full_fence()
    else:
        return False
    return True


@_jit
def wake_if_asleep(asleep, peer, wake):
    """After a stamp meant for `peer`: fence, then mark it in `wake` if it sleeps on its doorbell."""
    full_fence()
    if load_relaxed(asleep[peer]) != 0:
        wake[peer] = 1
        return 1
    return 0


@_jit
def wake_sleepers(asleep, live, me, wake):
    """After a stamp every live peer may wait for: fence once, then mark each peer whose ASLEEP word
    is up in `wake`; returns how many."""
    full_fence()
    n = 0
    for p in live:
        if p != me and load_relaxed(asleep[p]) != 0:
            wake[p] = 1
            n += 1
    return n


@_jit
def wake_reusers(asleep, live, me, wake):
    """After this rank consumed a buffer half: fence once, then mark in `wake` each peer that sleeps
    waiting to reuse one (ASLEEP_REUSE); returns how many."""
    full_fence()
    n = 0
    for p in live:
        if p != me and load_relaxed(asleep[p]) == ASLEEP_REUSE:
            wake[p] = 1
            n += 1
    return n


@_jit
def masked_by(members, live, me, generation):
    """The first live peer whose latest membership record (`Heap.mask`: two records of [generation,
    call seq, masked flag per rank] at members[p]) is newer than `generation` and masks this rank;
    -1 if none. A writer checks it after each block it puts into peers' memory."""
    words = 2 + members.size
    for p in live:
        if p == me:
            continue
        first, second = load_acquire(members[p]), load_acquire(members[p] + words * 8)
        latest = members[p] + (0 if first > second else words * 8)
        if max(first, second) > generation and load_relaxed(latest + (2 + me) * 8) != 0:
            return p
    return -1

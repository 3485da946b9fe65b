"""Engines: implementations of the kernel interface (`ubep.engine.base.Engine`).

`choose_engine` picks one by name (`ubep.registry.ENGINES`) and says why, the way
`ubep.group.choose_transport` does for transports: "auto" takes the compiled numba
engine where numba imports and its kernels compile and check out on this host, else
the portable torch engine.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

from ubep.engine.base import Engine
from ubep.engine.torch_engine import TorchEngine
from ubep.errors import CompileWaitTimeoutError
from ubep.registry import AUTO, ENGINES, NUMBA, TORCH, TRITON, one_of

# Every module that holds ubep's compiled functions (`ubep.engine.compile_once` names its markers by
# their sources).
NUMBA_MODULES = (
    "ubep.engine.numba_kernels",
    "ubep.engine.numba_sync",
    "ubep.protocols.combine.numba_halves",
    "ubep.protocols.ubep.numba_halves",
    "ubep.protocols.bsp.numba_halves",
    "ubep.protocols.ll.numba_halves",
)
# What a process imports before its first numba kernel runs, numba included: the numba engine, the
# modules above, and the costliest of those numba's CPU target imports on its first compile or cache
# load (`numba.core.cpu.CPUContext.load_additional_registries`). A fork server that imports them once
# (`ubep.launcher`) spares each rank it starts about 0.35 s of CPU (docs/benchmarks-log.md, "Building
# a Buffer"); it skips a name that does not import.
NUMBA_PRELOAD = (
    "ubep.engine.numba_engine",
    *NUMBA_MODULES,
    "numba.core.typing.npydecl",
    "numba.cpython.unicode",
    "numba.experimental.jitclass",
    "numba.np.arraymath",
    "numba.np.linalg",
    "numba.np.npdatetime",
    "numba.np.npyimpl",
    "numba.np.polynomial.polynomial_functions",
    "numba.np.random.generator_methods",
    "numba.np.random.legacy",
    "numba.typed.typeddict",
    "numba.typed.typedlist",
    "numba.typed.typedset",
)


@contextmanager
def collections_paused() -> Iterator[None]:
    """No garbage-collection pass inside (where the collector is on): importing numba and loading its
    target and the cached kernels make many objects, and each pass in a process that imported torch
    walks torch's too: a third of the CPU time of loading the kernels (docs/reliability.md, "A
    restarted rank rejoins"). The cycles made meanwhile go at the first pass after."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def choose_engine(
    requested: str = AUTO,
    deadline: float | None = None,
    halves: Mapping[str, Callable[[Engine], None]] | None = None,
    examples: bool = False,
) -> tuple[Engine, str]:
    """(engine, reason) for a requested name; ValueError names the choices.

    "numba" raises when numba is missing or its kernels (or the warm-ups of the call halves in
    `halves`, by name) fail; "auto" falls back to torch and gives the reason. The first call in a
    process compiles the numba kernels (once per host, `compile_once`) or loads them from numba's
    disk cache (see docs/benchmarks-log.md, "Engines"); waiting past `deadline` (time.monotonic) for
    another process's compile that shows no progress raises CompileWaitTimeoutError whatever was
    requested. `examples`: run the numba kernels' examples even where the cache was checked
    (`NumbaEngine.warm_up`).
    """
    one_of("engine", ENGINES, requested)
    if requested == TRITON.name:  # imported here: triton is optional, and on CPU needs TRITON_INTERPRET=1
        from ubep.engine.triton_engine import TritonEngine

        engine = TritonEngine()  # ValueError saying why where it cannot run
        return engine, f"requested: {engine.reason}"
    if requested == TORCH.name:
        return TorchEngine(), "requested"
    try:
        with collections_paused():
            from ubep.engine.numba_engine import NumbaEngine
    except ImportError as e:
        if requested == NUMBA.name:
            raise ImportError(
                "engine='numba' needs numba (the 'fast' extra: pip install '.[fast]' in ubep's clone)"
            ) from e
        return TorchEngine(), f"numba not installed ({e})"
    engine = NumbaEngine()
    try:
        cached = engine.warm_up(deadline, halves, examples)
    except CompileWaitTimeoutError:
        raise
    except Exception as e:  # a numba or LLVM failure on this host: any of them means "use torch"
        if requested == NUMBA.name:
            raise
        return TorchEngine(), f"numba kernels failed to compile or check ({type(e).__name__}: {e})"
    return engine, f"{'requested' if requested == NUMBA.name else 'compiled kernels'} ({cached})"


__all__ = ["NUMBA_MODULES", "NUMBA_PRELOAD", "Engine", "TorchEngine", "choose_engine", "collections_paused"]

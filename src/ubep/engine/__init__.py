"""Engines: implementations of the kernel interface (`ubep.engine.base.Engine`).

`choose_engine` picks one by name (`ubep.registry.ENGINES`) and says why, the way
`ubep.group.choose_transport` does for transports: "auto" takes the compiled numba
engine where numba imports and its kernels compile and check out on this host, else
the portable torch engine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ubep.engine.base import Engine
from ubep.engine.torch_engine import TorchEngine
from ubep.errors import CompileWaitTimeoutError
from ubep.registry import AUTO, ENGINES, NUMBA, TORCH, TRITON, one_of


def choose_engine(
    requested: str = AUTO,
    deadline: float | None = None,
    halves: Mapping[str, Callable[[Engine], None]] | None = None,
) -> tuple[Engine, str]:
    """(engine, reason) for a requested name; ValueError names the choices.

    "numba" raises when numba is missing or its kernels (or the warm-ups of the call halves in
    `halves`, by name) fail; "auto" falls back to torch and gives the reason. The first call in a
    process compiles the numba kernels (once per host, `compile_once`) or loads them from numba's
    disk cache (see docs/benchmarks-log.md, "Engines"); waiting past `deadline` (time.monotonic) for
    another process's compile that shows no progress raises CompileWaitTimeoutError whatever was
    requested.
    """
    one_of("engine", ENGINES, requested)
    if requested == TRITON.name:  # imported here: triton is optional, and on CPU needs TRITON_INTERPRET=1
        from ubep.engine.triton_engine import TritonEngine

        engine = TritonEngine()  # ValueError saying why where it cannot run
        return engine, f"requested: {engine.reason}"
    if requested == TORCH.name:
        return TorchEngine(), "requested"
    try:
        from ubep.engine.numba_engine import NumbaEngine
    except ImportError as e:
        if requested == NUMBA.name:
            raise ImportError(
                "engine='numba' needs numba (the 'fast' extra: pip install '.[fast]' in ubep's clone)"
            ) from e
        return TorchEngine(), f"numba not installed ({e})"
    engine = NumbaEngine()
    try:
        cached = engine.warm_up(deadline, halves)
    except CompileWaitTimeoutError:
        raise
    except Exception as e:  # a numba or LLVM failure on this host: any of them means "use torch"
        if requested == NUMBA.name:
            raise
        return TorchEngine(), f"numba kernels failed to compile or check ({type(e).__name__}: {e})"
    return engine, f"{'requested' if requested == NUMBA.name else 'compiled kernels'} ({cached})"


__all__ = ["Engine", "TorchEngine", "choose_engine"]

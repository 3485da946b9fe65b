"""Engines: implementations of the kernel interface (`ubep.engine.base.Engine`).

`choose_engine` picks one by name and says why, the way `ubep.group.choose_transport`
does for transports: "auto" takes the fastest engine that loads on this host.
"""

from __future__ import annotations

from ubep.engine.base import Engine
from ubep.engine.torch_engine import TorchEngine

ENGINES = ("auto", "torch", "triton")


def choose_engine(requested: str = "auto") -> tuple[Engine, str]:
    """(engine, reason) for a requested name; ValueError names the choices."""
    if requested not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {requested!r}")
    if requested == "triton":  # imported here: triton is optional, and on CPU needs TRITON_INTERPRET=1
        from ubep.engine.triton_engine import TritonEngine

        engine = TritonEngine()  # ValueError saying why where it cannot run
        return engine, f"requested: {engine.reason}"
    return TorchEngine(), "the portable torch kernels" if requested == "auto" else "requested"


__all__ = ["ENGINES", "Engine", "TorchEngine", "choose_engine"]

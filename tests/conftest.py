import os
import sys

# Test helpers (scenarios.py), the examples and scripts import by name, here and in the
# rank processes, which unpickle module-level functions by their module's name.
HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "scripts"))


def pytest_sessionstart(session) -> None:
    """Compile the numba kernels (or load them from numba's disk cache) once, in this process,
    so that rank processes started later find them cached instead of each compiling them."""
    from ubep.engine import choose_engine

    choose_engine("auto")

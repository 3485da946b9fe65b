"""Fixtures for every test folder. The helpers they share are modules in tests/support/; those, the
examples and the scripts import by name (pyproject.toml's `pythonpath`), here and in the rank
processes, which unpickle module-level functions by their module's name and receive this path."""

import sys

import pytest


def pytest_sessionstart(session) -> None:
    """Compile every numba kernel and call half (or load them from numba's disk cache) once, in
    this process, as `ubep warm` does, so that rank processes started later load them instead of
    waiting for one of them to compile."""
    from ubep.factory import ready_engine

    ready_engine("auto")


@pytest.fixture
def no_deep_ep():
    """No `deep_ep` module loaded during the test; every `deep_ep` name is restored afterwards."""
    saved = {k: v for k, v in sys.modules.items() if k == "deep_ep" or k.startswith("deep_ep.")}
    for k in saved:
        del sys.modules[k]
    yield
    for k in [k for k in sys.modules if k == "deep_ep" or k.startswith("deep_ep.")]:
        del sys.modules[k]
    sys.modules.update(saved)

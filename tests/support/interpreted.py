"""Test modules that run again under Triton's interpreter, in a fresh process (TRITON_INTERPRET must be
set before triton is imported, and no other test may see it).

A module calls `run_interpreted(__file__, timeout_s)` from its `test_interpreter_suite`, and marks the
tests that only make sense there with `interpreted`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in test_interpreter_suite")


def interpreter_env() -> dict[str, str]:
    """This environment with the interpreter on, and this checkout's ubep and test helpers importable."""
    import ubep

    src, support = os.path.dirname(os.path.dirname(ubep.__file__)), os.path.dirname(__file__)
    path = os.pathsep.join([src, support, os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)


def run_interpreted(module: str, timeout_s: float, *pytest_args: str) -> None:
    """Run the test module `module` (a path) under the interpreter; fail with its output if it fails."""
    if INTERPRETED:
        pytest.skip("already the interpreter run")
    pytest.importorskip("triton")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", *pytest_args, "-p", "no:cacheprovider", module]
    run = subprocess.run(cmd, env=interpreter_env(), capture_output=True, text=True, timeout=timeout_s)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and " failed" not in run.stdout, run.stdout[-2000:]

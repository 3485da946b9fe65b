"""The README's example runs and combines exactly what it dispatched."""

from __future__ import annotations

import importlib.util
import pathlib

import ubep


def test_quickstart_example():
    path = pathlib.Path(__file__).parents[1] / "examples" / "quickstart.py"
    spec = importlib.util.spec_from_file_location("quickstart", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = ubep.LocalLaunch(world_size=4, timeout_s=120).run(module.moe_step)
    assert results == [(64, 0.0)] * 4

"""The README's example runs and combines exactly what it dispatched."""

from __future__ import annotations

import quickstart  # examples/ is on the path (conftest.py)

import ubep


def test_quickstart_example():
    results = ubep.LocalLaunch(world_size=4, timeout_s=120).run(quickstart.moe_step)
    assert results == [(64, 0.0)] * 4

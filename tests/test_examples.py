"""The README's example runs and combines exactly what it dispatched."""

from __future__ import annotations

import quickstart  # examples/ is on the path (conftest.py)

import ubep


def test_quickstart_example():
    results = ubep.LocalLaunch(world_size=4, timeout_s=120).run(quickstart.moe_step)
    assert results == [(64, 0.0)] * 4


def test_placement_example_moves_weights_and_keeps_the_outputs():
    import placement

    diffs = ubep.LocalLaunch(world_size=4, ranks_per_node=2, timeout_s=120).run(placement.rebalance_step)
    assert max(diffs) < 1e-5  # the same layer before and after: only float32 sums regroup

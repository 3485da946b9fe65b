"""The fault soak, short: one group of 4 ranks, 80 checked iterations with a corrupt count, a kill
and a stall injected, then one stop-inside-put episode; survivors mask the dead and stay exact,
blame the right rank, leave nothing."""

from __future__ import annotations

import fault_soak  # scripts/ is on the path (conftest.py)
import pytest


@pytest.mark.timeout(240)
@pytest.mark.parametrize("protocol", ["ubep", "bsp"])
def test_short_fault_soak(protocol):
    cfg = fault_soak.FaultSoakConfig(
        iterations=80, segment=80, world_size=4, protocol=protocol, seed=1, stops=1
    )
    report = fault_soak.run(cfg)
    assert report.wrong == [] and report.misblamed == [] and report.left_names == []
    kinds = fault_soak.summary(report)
    assert kinds["corrupt"]["seen"] >= 3 and kinds["kill"]["seen"] == 3 and kinds["stall"]["seen"] == 2, kinds
    assert kinds["stopped inside put (this rank)"]["seen"] == 1 and kinds["stop"]["seen"] >= 1, kinds
    # a kill is seen before the deadline, a stall at it
    assert kinds["kill"]["max_s"] < cfg.timeout_s and kinds["stall"]["max_s"] < 3 * cfg.timeout_s, kinds
    assert report.checked_calls > 3 * 2 * 60  # the survivors kept going after each fault

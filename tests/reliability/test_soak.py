"""The soak script, short: 200 random calls on 4 ranks, every one checked against the
reference, with no segment left and no runaway memory growth."""

from __future__ import annotations

import pytest
import soak  # scripts/ is on the path (conftest.py)


@pytest.mark.parametrize("protocol,calls", [("ubep", 200), ("bsp", 100)])
def test_short_soak(protocol, calls):
    config = soak.SoakConfig(calls=calls, world_size=4, protocol=protocol)
    report = soak.run_soak(config, launch_timeout_s=240)
    assert [r.calls for r in report.ranks] == [calls] * 4
    assert report.failures == 0, [r.first_failures for r in report.ranks]
    assert all(r.shm_segments_seen == 0 for r in report.ranks)
    assert report.ubep_names_after <= report.ubep_names_before
    grown = [r.rss_end_mb - r.rss_warm_mb for r in report.ranks]
    # After warm-up the remaining calls must not grow a rank by more than a few MiB (shapes of the
    # bf16 reduction are padded so the matrix library's per-shape kernel cache stays bounded).
    assert max(grown) < 16, f"resident memory grew {max(grown):.0f} MiB over the soak"

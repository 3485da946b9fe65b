"""The mechanisms the ablations rest on: per-class windows, and the scheduling ablation's ordering."""

import numpy as np
import pytest

from ubep import topology
from ubep.costmodel import CostParams, worker_gbps_C
from ubep.sim import ablation, engine


def test_a_window_per_distance_class_sets_each_class_rate():
    topo = topology.cm384()  # latencies 0.218 / 0.929 / 2.5 us, 392 GB/s
    params = CostParams(window_bytes=(1e9, 8192, 4096), link_efficiency=1.0)
    assert worker_gbps_C(topo, params).tolist() == pytest.approx(
        [1500.0, 8192 / 0.929 / 1e3, 4096 / 2.5 / 1e3]
    )
    two = CostParams(window_bytes=(1e9, 8192))  # the last entry covers farther classes
    assert worker_gbps_C(topo, two)[2] == pytest.approx(8192 / 2.5 / 1e3)


def test_a_far_only_worker_straggles_behind_a_mixed_one():
    # Rank 0 of cm384: rank 1 is one hop away, rank 100 two. Two workers, equal bytes:
    # "balanced" gives one all the near bytes and the other all the far ones; "mixed" splits both.
    params = CostParams(msg_overhead_us=0.0, link_efficiency=1.0, window_bytes=16384)
    b = 200_000

    def slowest(dst, worker):
        n = len(dst)
        m = engine.Messages(
            src_Z=np.zeros(n, dtype=np.int64), dst_Z=np.array(dst), worker_Z=np.array(worker),
            seq_Z=np.arange(n, dtype=float), bytes_Z=np.full(n, b), ready_Z=np.zeros(n),
        )  # fmt: skip
        return engine.simulate(m, topology.cm384(), params, workers=2).injected_Z.max()

    near, far = 16384 / 0.929, 16384 / 2.5  # bytes per us: window / latency, far below the port
    balanced = slowest([1, 1, 100, 100], [0, 0, 1, 1])
    mixed = slowest([1, 100, 1, 100], [0, 0, 1, 1])
    assert balanced == pytest.approx(2 * b / far, rel=1e-9)
    assert mixed == pytest.approx(b / near + b / far, rel=1e-9)


def test_the_scheduling_ablation_keeps_the_papers_order():
    bars = {b.label: b.simulated for b in ablation.scheduling(CostParams(), ablation.FIT_HOT_SHARE)}
    assert bars["bsp"] > bars["balanced"] > bars["distance"]

"""The simulator: closed-form cases for the fabric model, then protocol-level sanity."""

import numpy as np
import pytest

from ubep import topology
from ubep.costmodel import CostParams
from ubep.sim import engine

BIG_WINDOW = CostParams(msg_overhead_us=0.0, link_efficiency=1.0, window_bytes=1e12)


def _msgs(src, dst, nbytes, worker=None, seq=None, ready=None):
    src, dst = np.asarray(src), np.asarray(dst)
    n = src.size
    return engine.Messages(
        src_M=src,
        dst_M=dst,
        worker_M=np.zeros(n, dtype=np.int64) if worker is None else np.asarray(worker),
        seq_M=np.arange(n) if seq is None else np.asarray(seq),
        bytes_M=np.full(n, nbytes),
        ready_M=np.zeros(n) if ready is None else np.asarray(ready, dtype=float),
    )


def test_one_message_costs_overhead_latency_and_bytes_over_bandwidth():
    params = CostParams(msg_overhead_us=0.5, link_efficiency=0.75, window_bytes=1e12)
    t = engine.simulate(_msgs([0], [100], 1_000_000), topology.cm384(), params, workers=1)
    expect = 0.5 + 2.5 + 1_000_000 / (0.75 * 392 * 1e3)  # o + two-hop latency + b / (eta * B)
    assert t.arrived_M[0] == pytest.approx(expect, rel=1e-9)
    assert t.cls_M[0] == 2


def test_a_worker_streams_no_faster_than_its_window_allows():
    params = CostParams(msg_overhead_us=0.2, link_efficiency=1.0, window_bytes=8192)
    n, b = 10, 50_000
    t = engine.simulate(_msgs([0] * n, [1] * n, b), topology.cm384(), params, workers=1)
    rate = 8192 / 0.93  # bytes per us: window / one-hop latency, far below 392 GB/s
    assert t.arrived_M.max() == pytest.approx(n * (0.2 + b / rate) + 0.93, rel=1e-9)


def test_all_to_all_on_a_non_blocking_switch():
    R, b = 16, 200_000
    src, dst, seq = [], [], []
    for s in range(R):
        for i in range(1, R):  # rotation order, one worker per destination
            src.append(s), dst.append((s + i) % R), seq.append(i)
    t = engine.simulate(_msgs(src, dst, b, worker=seq, seq=seq), topology.nvl72(), BIG_WINDOW, workers=R)
    assert t.arrived_M.max() == pytest.approx(1.0 + (R - 1) * b / 900e3, rel=1e-9)


def test_incast_is_limited_by_the_receivers_ejection_bandwidth():
    senders, b = 40, 100_000
    t = engine.simulate(_msgs(np.arange(1, senders + 1), [0] * senders, b), topology.nvl72(), BIG_WINDOW, 1)
    assert t.arrived_M.max() == pytest.approx(1.0 + senders * b / 900e3, rel=1e-9)
    assert t.injected_M.max() == pytest.approx(b / 900e3, rel=1e-9)  # senders are not the bottleneck


def test_a_capped_uplink_is_shared_by_the_whole_domain():
    topo = topology.from_dict(
        {
            "ports_gbps": {"p": 100},
            "levels": [
                {"name": "d", "span": 1, "latency_us": 0.1, "port": "p"},
                {"name": "rack", "span": 4, "latency_us": 1.0, "port": "p", "uplink_gbps": 50},
                {"name": "row", "span": 8, "latency_us": 3.0, "port": "p"},
            ],
        }
    )
    b = 1_000_000
    t = engine.simulate(_msgs([0, 1, 2, 3], [4, 5, 6, 7], b), topo, BIG_WINDOW, workers=1)
    assert t.arrived_M.max() == pytest.approx(3.0 + 4 * b / 50e3, rel=1e-9)
    inside = engine.simulate(_msgs([0, 1, 2], [1, 2, 3], b), topo, BIG_WINDOW, workers=1)
    assert inside.arrived_M.max() == pytest.approx(1.0 + b / 100e3, rel=1e-9)  # no uplink used


def test_ready_times_and_holds_delay_the_worker():
    m = _msgs([0, 0], [1, 1], 0, ready=[5.0, 0.0])
    m = engine.Messages(**{**{f: getattr(m, f) for f in m.__slots__}, "hold_us_M": np.array([2.0, 0.0])})
    t = engine.simulate(m, topology.nvl72(), BIG_WINDOW, workers=1)
    assert t.issued_M.tolist() == [7.0, 7.0]  # second waits for the first's hold
    assert t.arrived_M.tolist() == [6.0, 8.0]


def test_fifo_matches_a_plain_loop():
    rng = np.random.default_rng(0)
    key, order = rng.integers(0, 3, 50), rng.random(50)
    head = rng.random(50) * 10
    tail, svc = head + rng.random(50), rng.random(50)
    start, out = engine.fifo(key, order, head, tail, svc)
    for k in range(3):
        done = -np.inf
        for i in sorted(np.flatnonzero(key == k), key=lambda i: order[i]):
            assert start[i] == pytest.approx(max(head[i], done))
            done = max(head[i], done) + svc[i]
            assert out[i] == pytest.approx(max(tail[i], done))

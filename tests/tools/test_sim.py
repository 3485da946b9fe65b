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
        src_Z=src,
        dst_Z=dst,
        worker_Z=np.zeros(n, dtype=np.int64) if worker is None else np.asarray(worker),
        seq_Z=np.arange(n) if seq is None else np.asarray(seq),
        bytes_Z=np.full(n, nbytes),
        ready_Z=np.zeros(n) if ready is None else np.asarray(ready, dtype=float),
    )


def test_one_message_costs_overhead_latency_and_bytes_over_bandwidth():
    params = CostParams(msg_overhead_us=0.5, link_efficiency=0.75, window_bytes=1e12)
    t = engine.simulate(_msgs([0], [100], 1_000_000), topology.cm384(), params, workers=1)
    expect = 0.5 + 2.5 + 1_000_000 / (0.75 * 392 * 1e3)  # o + two-hop latency + b / (eta * B)
    assert t.arrived_Z[0] == pytest.approx(expect, rel=1e-9)
    assert t.cls_Z[0] == 2


def test_a_worker_streams_no_faster_than_its_window_allows():
    params = CostParams(msg_overhead_us=0.2, link_efficiency=1.0, window_bytes=8192)
    n, b = 10, 50_000
    t = engine.simulate(_msgs([0] * n, [1] * n, b), topology.cm384(), params, workers=1)
    rate = 8192 / 0.929  # bytes per us: window / one-hop latency, far below 392 GB/s
    assert t.arrived_Z.max() == pytest.approx(n * (0.2 + b / rate) + 0.929, rel=1e-9)


def test_all_to_all_on_a_non_blocking_switch():
    R, b = 16, 200_000
    src, dst, seq = [], [], []
    for s in range(R):
        for i in range(1, R):  # rotation order, one worker per destination
            src.append(s), dst.append((s + i) % R), seq.append(i)
    t = engine.simulate(_msgs(src, dst, b, worker=seq, seq=seq), topology.nvl72(), BIG_WINDOW, workers=R)
    assert t.arrived_Z.max() == pytest.approx(1.0 + (R - 1) * b / 900e3, rel=1e-9)


def test_incast_is_limited_by_the_receivers_ejection_bandwidth():
    senders, b = 40, 100_000
    t = engine.simulate(_msgs(np.arange(1, senders + 1), [0] * senders, b), topology.nvl72(), BIG_WINDOW, 1)
    assert t.arrived_Z.max() == pytest.approx(1.0 + senders * b / 900e3, rel=1e-9)
    assert t.injected_Z.max() == pytest.approx(b / 900e3, rel=1e-9)  # senders are not the bottleneck


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
    assert t.arrived_Z.max() == pytest.approx(3.0 + 4 * b / 50e3, rel=1e-9)
    inside = engine.simulate(_msgs([0, 1, 2], [1, 2, 3], b), topo, BIG_WINDOW, workers=1)
    assert inside.arrived_Z.max() == pytest.approx(1.0 + b / 100e3, rel=1e-9)  # no uplink used


def test_ready_times_and_holds_delay_the_worker():
    m = _msgs([0, 0], [1, 1], 0, ready=[5.0, 0.0])
    m = engine.Messages(**{**{f: getattr(m, f) for f in m.__slots__}, "hold_us_Z": np.array([2.0, 0.0])})
    t = engine.simulate(m, topology.nvl72(), BIG_WINDOW, workers=1)
    assert t.issued_Z.tolist() == [7.0, 7.0]  # second waits for the first's hold
    assert t.arrived_Z.tolist() == [6.0, 8.0]


def test_two_flows_on_one_port_each_get_half():
    b = 1_000_000  # two workers of rank 0 start together, to two different ranks
    t = engine.simulate(_msgs([0, 0], [1, 2], b, worker=[0, 1]), topology.nvl72(), BIG_WINDOW, workers=2)
    assert t.injected_Z.tolist() == pytest.approx([2 * b / 900e3] * 2, rel=1e-9)  # FIFO: b/B, then 2b/B
    assert t.arrived_Z.tolist() == pytest.approx([1.0 + 2 * b / 900e3] * 2, rel=1e-9)


def test_a_capped_flow_keeps_its_cap_and_the_other_takes_the_rest():
    b, rate = 1000.0, 100.0  # one port of 100 B/us; flow 0 arrives at 25 B/us (its upstream rate)
    key, head = np.zeros(2, dtype=np.int64), np.zeros(2)
    out = engine.fair_share(key, head, np.array([b / 25, 0.0]), np.full(2, b), np.full(2, rate))
    assert out.tolist() == pytest.approx([b / 25, b / 75], rel=1e-9)  # max-min: 25 and 75 B/us


def test_fair_share_matches_a_small_step_simulation():
    rng = np.random.default_rng(1)
    n, rate = 12, 50.0
    head, nbytes = np.sort(rng.random(n) * 20), rng.random(n) * 300 + 1
    cap = rng.choice([5.0, 20.0, np.inf], n)
    tail = head + np.where(np.isinf(cap), 0.0, nbytes / np.where(np.isinf(cap), 1.0, cap))
    out = engine.fair_share(np.zeros(n, dtype=np.int64), head, tail, nbytes, np.full(n, rate))
    rem, done, dt, t = nbytes.copy(), np.full(n, np.nan), 1e-3, 0.0
    while np.isnan(done).any():  # brute force: water-fill the rate among present flows every dt
        live = np.flatnonzero((head <= t) & np.isnan(done))
        share, left, order = np.zeros(n), rate, live[np.argsort(cap[live])]
        for j, i in enumerate(order):
            share[i] = min(cap[i], left / (order.size - j))
            left -= share[i]
        rem -= share * dt
        t += dt
        done[np.isnan(done) & (rem <= 0)] = t
    assert out == pytest.approx(np.maximum(done, tail), abs=0.02)


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


# --- protocols on the model ----------------------------------------------------------------

from dataclasses import replace  # noqa: E402

from ubep.sim import protocols, run  # noqa: E402
from ubep.sim.commands import add_parser  # noqa: E402

SMALL = run.SimConfig(topology=topology.cm_ablation(), ranks=32, tokens=16, workers=8)


def test_barrier_on_two_ranks_waits_for_the_other_ranks_flag():
    params = CostParams(
        msg_overhead_us=0.0, link_efficiency=1.0, window_bytes=1e12, poll_us=0.05, flag_bytes=64
    )
    topo = topology.cm_ablation()
    out = protocols.barrier(np.array([0.0, 3.0]), topo, params, workers=4)
    hop = 0.929 + 64 / (392 * 1e3)  # one-hop flag write: latency + bytes / bandwidth
    assert out[0] == pytest.approx(3.0 + hop + 0.05)  # rank 0 leaves once rank 1's flag has landed
    assert out[1] == pytest.approx(3.0 + 0.05)  # rank 0's flag was already there when rank 1 entered


def test_barrier_on_many_ranks_costs_one_hop_and_the_flags_issue():
    params = CostParams(msg_overhead_us=0.1, link_efficiency=1.0, window_bytes=1e12, poll_us=0.05)
    R, W = 16, 4  # all 16 ranks on one node of cm-ablation: one hop; 15 flags over 4 workers: 4 deep
    out = protocols.barrier(np.zeros(R), topology.cm_ablation(), params, workers=W)
    flag = 0.1 + 64 / 392e3  # issue overhead + bytes
    least = 4 * flag + 0.929 + 0.05
    assert least - 1e-9 <= out.max() <= least + (R - 1) * 64 / 392e3  # + at most the incast of 15 flags


def test_scheduled_pieces_carry_every_token_byte_once():
    wl = run.workload(SMALL)
    sched = protocols.schedule.plan(wl.counts_RR(), SMALL.topology, workers=7, row_bytes=100)
    msgs = protocols.pieces(sched, np.zeros(SMALL.ranks), worker_offset=1)
    sent_RR = np.zeros((SMALL.ranks, SMALL.ranks))
    np.add.at(sent_RR, (msgs.src_Z, msgs.dst_Z), msgs.bytes_Z)
    # Independent count: distinct owner ranks per token, from the raw routing.
    owners = wl.owner_E[wl.topk_RNK]
    expect = np.zeros_like(sent_RR)
    for s in range(SMALL.ranks):
        for n in range(SMALL.tokens):
            for d in set(owners[s, n].tolist()):
                expect[s, d] += 100
    assert np.array_equal(sent_RR, expect)


@pytest.mark.parametrize("protocol", run.PROTOCOLS)
def test_more_bandwidth_never_slows_a_protocol_down(protocol):
    # With 8 workers the workers' windows bind (equal times); with 64 the port does for part of
    # the time, so the slowest worker gets faster (the end may stay window-bound).
    for workers, better in ((8, np.less_equal), (64, np.less)):
        cfg = replace(SMALL, workers=workers, tokens=64)
        wl = run.workload(cfg)
        slow = run.simulate(cfg, protocol, wl)
        fast = run.simulate(replace(cfg, topology=cfg.topology.with_ports(fabric=4 * 392.0)), protocol, wl)
        assert fast.dispatch_us <= slow.dispatch_us and fast.combine_us <= slow.combine_us
        assert better(fast.dispatch_worker_us, slow.dispatch_worker_us)


def test_ubep_beats_bsp_and_deepep_ll_sends_one_message_per_expert():
    wl = run.workload(SMALL)
    u, b = (run.simulate(SMALL, p, wl) for p in ("ubep", "bsp"))
    assert u.dispatch_us < b.dispatch_us and u.combine_us < b.combine_us
    ll = run.simulate(SMALL, "deepep-ll", wl)
    assert ll.dispatch_bytes_per_rank == SMALL.tokens * SMALL.topk * run.row_bytes(SMALL.hidden, "bf16")
    assert u.dispatch_bytes_per_rank < ll.dispatch_bytes_per_rank  # per-rank dedup


def test_host_simulation_follows_the_measured_copy_rate():
    slow = run.simulate_host(2.0, 1.0, ranks=4, tokens=16, hidden=512, experts=16)
    fast = run.simulate_host(20.0, 1.0, ranks=4, tokens=16, hidden=512, experts=16)
    assert fast.dispatch_us < slow.dispatch_us


def test_cli_writes_json(tmp_path):
    import argparse
    import json

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    path = tmp_path / "out.json"
    args = parser.parse_args(
        ["simulate", "--topology", "cm-ablation", "--ranks", "16", "--tokens", "8", "--protocol", "ubep,bsp",
         "--workers", "4", "--json", str(path)]
    )  # fmt: skip
    assert args.func(args) == 0
    data = json.loads(path.read_text())
    assert {r["protocol"] for r in data["results"]} == {"ubep", "bsp"}
    assert data["results"][0]["ranks"] == 16 and data["results"][0]["dispatch_us"] > 0

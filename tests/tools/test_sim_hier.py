"""Node-level dedup (protocol ubep-hier) on the simulator, and the ablation command."""

import argparse
import json

import numpy as np

from ubep import topology
from ubep.sim import hier, protocols, run
from ubep.sim.commands import add_parser

TWO_NODES = topology.from_dict(
    {
        "ports_gbps": {"nvlink": 100, "net": 5},
        "levels": [
            {"name": "device", "span": 1, "latency_us": 0.2, "port": "nvlink"},
            {"name": "node", "span": 4, "latency_us": 1.0, "port": "nvlink"},
            {"name": "cluster", "span": 8, "latency_us": 3.0, "port": "net"},
        ],
    }
)


def _workload(topk_RNK) -> protocols.Workload:
    return protocols.Workload(topk_RNK=np.asarray(topk_RNK), owner_E=np.arange(8),  # expert e on rank e
                              dispatch_row_bytes=100, combine_row_bytes=100)  # fmt: skip


def test_a_token_crosses_to_a_remote_node_once_through_its_relay():
    topk = -np.ones((8, 1, 3), dtype=np.int64)
    topk[1, 0] = [4, 6, 7]  # rank 1's token: three ranks of node 1
    topk[5, 0] = [1, 4, -1]  # rank 5's token: one rank of node 0 and rank 4 (its own node)
    counts, relay = hier.node_counts(_workload(topk), V=4)
    assert counts[1, [4, 6, 7]].tolist() == [1, 1, 1] and counts[5, [1, 4]].tolist() == [1, 1]
    expect = np.zeros((8, 8), dtype=np.int64)
    expect[1, 5] = 1  # relay of rank 1 on node 1: rank 4 + 1 % 4 = 5
    expect[5, 1] = 1  # relay of rank 5 on node 0: rank 5 % 4 = 1
    assert np.array_equal(relay, expect)


def test_dedup_sends_fewer_bytes_and_wins_on_a_slow_network():
    cfg = run.SimConfig(topology=TWO_NODES, ranks=8, tokens=64, hidden=1024, experts=64, topk=8, workers=8)
    wl = run.workload(cfg)
    flat, dedup = (run.simulate(cfg, p, wl) for p in ("ubep", "ubep-hier"))
    assert dedup.dispatch_bytes_per_rank < flat.dispatch_bytes_per_rank
    assert dedup.dispatch_us < flat.dispatch_us and dedup.combine_us < flat.combine_us


def test_sync_ablation_writes_the_paper_beside_ours(tmp_path):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    out, png = tmp_path / "sync.json", tmp_path / "sync.png"
    argv = ["simulate", "--ablation", "sync", "--ranks", "16", "--tokens", "8"]
    args = parser.parse_args([*argv, "--json", str(out), "--plot", str(png)])
    assert args.func(args) == 0
    bars = json.loads(out.read_text())["bars"]
    assert {b["label"] for b in bars} == {"tff", "dc", "sp"} and png.stat().st_size > 0

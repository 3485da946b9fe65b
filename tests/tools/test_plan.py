"""`ubep plan` on small custom fabrics where the right advice is known in advance."""

from ubep import topology
from ubep.sim.plan import plan


def _fabric(net_gbps: float | None) -> topology.Topology:
    """Two nodes of four devices on a 100 GB/s port; between nodes a `net_gbps` port (None: one tier)."""
    levels = [
        {"name": "device", "span": 1, "latency_us": 0.2, "port": "nvlink"},
        {"name": "node", "span": 4, "latency_us": 1.0, "port": "nvlink"},
    ]
    ports = {"nvlink": 100}
    if net_gbps is None:
        levels[1]["span"] = 8
    else:
        levels.append({"name": "cluster", "span": 8, "latency_us": 3.0, "port": "net"})
        ports["net"] = net_gbps
    return topology.from_dict(
        {"name": "small", "ports_gbps": ports, "levels": levels, "local_copy_gbps": 500}
    )


def test_a_slow_network_between_nodes_calls_for_node_level_dedup_and_is_named_the_bottleneck():
    # 128 experts, top-8 over 8 ranks: a token reaches ~2.6 of the remote node's 4 ranks, so
    # sending it once per node cuts the slow port's bytes by ~2.6x; nothing else comes close.
    advice, preds = plan(_fabric(5.0), model="qwen3-30b", batches=(8, 128))
    assert advice.protocol == "ubep-hier"
    assert "'net'" in preds[-1].bottleneck
    assert preds[-1].dispatch_us > preds[0].dispatch_us


def test_on_one_tier_the_policies_tie_and_dedup_is_not_offered():
    advice, _ = plan(_fabric(None), model="qwen3-30b", batches=(32,))
    assert advice.protocol in ("ubep", "bsp")
    assert any("tie" in line for line in advice.reasons)  # no distance to exploit on a flat fabric

"""Topology model: distance classes, presets, custom files."""

import json

import numpy as np
import pytest

from ubep import topology


def test_cm384_classes_follow_nodes_of_eight():
    topo = topology.cm384()
    assert topo.num_devices == 384
    cls = topo.class_matrix(24)
    assert cls[0, 0] == 0 and cls[0, 7] == 1 and cls[0, 8] == 2
    assert cls[9, 15] == 1 and cls[9, 16] == 2 and cls[23, 16] == 1
    assert np.array_equal(cls, cls.T)
    assert topo.latency_C().tolist() == [0.218, 0.929, 2.5]
    assert (topo.port_gbps_C() == 392.0).all()


def test_hgx_uses_nvlink_inside_a_node_and_rdma_between():
    topo = topology.hgx_h800_ib(num_nodes=4)
    assert topo.num_devices == 32
    assert topo.distance_class(3, 5) == 1 and topo.distance_class(3, 8) == 2
    assert topo.port_gbps_C().tolist() == [200.0, 200.0, 50.0]


def test_nvl72_is_one_tier_and_nvl576_two():
    assert topology.nvl72().class_matrix(72).max() == 1
    nvl = topology.nvl576()
    assert nvl.distance_class(71, 72) == 2 and nvl.distance_class(72, 143) == 1


def test_ablation_machine_is_four_nodes_of_sixteen():
    cls = topology.cm_ablation().class_matrix(64)
    assert (cls[0, 1:16] == 1).all() and (cls[0, 16:] == 2).all()


def test_host_groups_cores_by_numa_node():
    topo = topology.host(copy_gbps=5.0, cores=8, numa_nodes=2)
    assert [lv.span for lv in topo.levels] == [1, 4, 8]
    assert topo.distance_class(0, 3) == 1 and topo.distance_class(3, 4) == 2
    assert topo.local_copy_gbps == 5.0
    assert topology.host(cores=4, numa_nodes=1).num_classes == 2


def test_custom_json_round_trip(tmp_path):
    spec = {
        "name": "two-racks",
        "ports_gbps": {"fast": 100, "slow": 10},
        "levels": [
            {"name": "device", "span": 1, "latency_us": 0.1, "port": "fast"},
            {"name": "rack", "span": 4, "latency_us": 1.0, "port": "fast"},
            {"name": "row", "span": 8, "latency_us": 5.0, "port": "slow", "uplink_gbps": 20},
        ],
    }
    path = tmp_path / "topo.json"
    path.write_text(json.dumps(spec))
    topo = topology.load(str(path))
    assert topo.num_devices == 8 and topo.levels[2].uplink_gbps == 20
    assert topo.port_gbps_C().tolist() == [100.0, 100.0, 10.0]


@pytest.mark.parametrize(
    "levels",
    [
        [{"name": "a", "span": 2, "latency_us": 1, "port": "p"}],
        [
            {"name": "a", "span": 1, "latency_us": 1, "port": "p"},
            {"name": "b", "span": 3, "latency_us": 1, "port": "q"},
        ],
        [
            {"name": "a", "span": 1, "latency_us": 1, "port": "p"},
            {"name": "b", "span": 6, "latency_us": 1, "port": "p"},
            {"name": "c", "span": 8, "latency_us": 1, "port": "p"},
        ],
    ],
)
def test_bad_topologies_are_rejected(levels):
    with pytest.raises(ValueError, match="topology"):
        topology.from_dict({"ports_gbps": {"p": 1}, "levels": levels})


def test_unknown_name_is_rejected():
    with pytest.raises(ValueError, match="topology must be one of"):
        topology.load("nvl9000")

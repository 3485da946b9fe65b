"""Topology: ranks -> devices -> nodes -> switch tiers, and what each distance costs.

A topology is a stack of nested levels. Level i groups `span` consecutive
devices into one domain (level 0 spans 1 device: the device itself; the last
level spans the whole machine). Two devices are at *distance class* i when the
smallest domain holding both is at level i. Each class has a one-way latency
and is carried by one of the device's ports (a named bandwidth); a level may
also cap the bandwidth leaving one of its domains (an oversubscribed uplink).

Legend: R ranks, D devices, C distance classes (= number of levels).
Units: microseconds (us), GB/s (= 1e3 bytes per us), bytes.
Every figure carries its source here and in docs/topology.md.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from itertools import pairwise
from pathlib import Path

import numpy as np

# --- Published figures (docs/paper_figures.md, "Fabrics") ------------------------------
CM384_LATENCY_US = (0.218, 0.929, 2.5)  # same device / one switch hop / two hops (UBEP paper, measured)
CM384_DEVICE_GBPS = 392.0  # unidirectional UB bandwidth per NPU (CloudMatrix384 paper)
CM384_NODES, CM384_DEVICES_PER_NODE = 48, 8  # 384 NPUs in 48 nodes of 8
NVLINK5_DEVICE_GBPS = 900.0  # GB200 NVL72, NVLink 5, unidirectional per GPU
NVL72_DEVICES, NVL576_RACKS = 72, 8
H800_NVLINK_GBPS = 200.0  # H800 NVLink 4 (400 GB/s bidirectional); 150-450 GB/s achieved (paper_figures.md)
RDMA_NIC_GBPS = 50.0  # one 400 Gb/s NIC per GPU
HGX_DEVICES_PER_NODE = 8
HGX_LATENCY_US = (0.2, 1.5, 3.5)  # local; NVLink ~1-2 us; RDMA ~2-5 us (midpoints of the published ranges)
# --- Assumptions where no public figure exists (stated in docs/topology.md) -------------
NVLINK5_LATENCY_US = (0.2, 1.0, 2.0)  # local / one NVSwitch hop / two tiers (NVL576): assumed
HBM_COPY_GBPS = 1500.0  # device-local copy rate for reorder/reduce (HBM3-class, half of peak): assumed
HOST_COPY_GBPS = 8.0  # one core's memcpy rate, a default until measured by `ubep bench`
HOST_LATENCY_US = (0.1, 0.3, 0.6)  # same core / same NUMA node / across NUMA nodes: assumed


@dataclass(frozen=True, kw_only=True, slots=True)
class Level:
    """One tier of the machine: domains of `span` devices."""

    name: str
    span: int  # devices per domain at this level
    latency_us: float  # one-way latency between devices whose nearest common domain is this one
    port: str  # the device port that carries traffic of this distance class
    uplink_gbps: float | None = None  # bandwidth out of (and into) one domain; None: non-blocking


@dataclass(frozen=True, kw_only=True, slots=True)
class Topology:
    """A machine: nested levels (innermost first), device ports, local copy rate."""

    name: str
    levels: tuple[Level, ...]
    ports_gbps: tuple[tuple[str, float], ...]  # (port name, unidirectional GB/s per device)
    local_copy_gbps: float = HBM_COPY_GBPS
    ranks_per_device: int = 1
    source: str = ""

    def __post_init__(self) -> None:
        spans = [lv.span for lv in self.levels]
        if not spans or spans[0] != 1:
            raise ValueError("topology: level 0 must span exactly one device")
        if any(b % a for a, b in pairwise(spans)) or spans != sorted(set(spans)):
            raise ValueError(f"topology: level spans must strictly grow and divide each other, got {spans}")
        names = {p for p, _ in self.ports_gbps}
        if missing := {lv.port for lv in self.levels} - names:
            raise ValueError(f"topology: levels use undefined ports {sorted(missing)}")

    @property
    def num_devices(self) -> int:
        return self.levels[-1].span

    @property
    def num_ranks(self) -> int:
        return self.num_devices * self.ranks_per_device

    @property
    def num_classes(self) -> int:
        return len(self.levels)

    @property
    def port_names(self) -> tuple[str, ...]:
        return tuple(p for p, _ in self.ports_gbps)

    def device_of(self, ranks: np.ndarray | int) -> np.ndarray:
        return np.asarray(ranks) // self.ranks_per_device

    def distance_class(self, src: np.ndarray | int, dst: np.ndarray | int) -> np.ndarray:
        """int64, broadcast over src/dst ranks: the level of their nearest common domain."""
        a, b = self.device_of(src), self.device_of(dst)
        cls = np.zeros(np.broadcast(a, b).shape, dtype=np.int64)
        for i, lv in enumerate(self.levels[1:], start=1):
            cls = np.where((a // lv.span == b // lv.span) & (cls == 0) & (a != b), i, cls)
        return cls

    def class_matrix(self, num_ranks: int) -> np.ndarray:
        """int64 [R, R]: distance class between every pair of the first R ranks."""
        ranks = np.arange(num_ranks)
        return self.distance_class(ranks[:, None], ranks[None, :])

    def latency_C(self) -> np.ndarray:
        return np.array([lv.latency_us for lv in self.levels])

    def port_of_class_C(self) -> np.ndarray:
        """int64 [C]: index into `ports_gbps` of the port each class uses."""
        return np.array([self.port_names.index(lv.port) for lv in self.levels])

    def port_gbps_C(self) -> np.ndarray:
        """float [C]: nominal bandwidth of the port each class uses."""
        gbps = np.array([g for _, g in self.ports_gbps])
        return gbps[self.port_of_class_C()]

    def with_ports(self, **gbps: float) -> Topology:
        """A copy with some port bandwidths replaced (for what-if sweeps and tests)."""
        ports = tuple((p, gbps.get(p, g)) for p, g in self.ports_gbps)
        return replace(self, ports_gbps=ports)


def superpod(
    name: str,
    *,
    spans: tuple[int, ...],
    latency_us: tuple[float, ...],
    device_gbps: float,
    uplink_gbps: tuple[float | None, ...] | None = None,
    source: str = "",
) -> Topology:
    """A one-port machine (all classes on one fabric): the shape of CM384 and NVL72/576."""
    names = ("device", "node", "pod", "tier3")[: len(spans)]
    uplinks = uplink_gbps or (None,) * len(spans)
    levels = tuple(
        Level(name=n, span=s, latency_us=lat, port="fabric", uplink_gbps=up)
        for n, s, lat, up in zip(names, spans, latency_us, uplinks, strict=True)
    )
    return Topology(name=name, levels=levels, ports_gbps=(("fabric", device_gbps),), source=source)


def cm384(devices_per_node: int = CM384_DEVICES_PER_NODE, num_devices: int = 384) -> Topology:
    """Huawei CloudMatrix384: nodes of 8 NPUs, two UB switch tiers (assumed non-blocking)."""
    return superpod(
        "cm384",
        spans=(1, devices_per_node, num_devices),
        latency_us=CM384_LATENCY_US,
        device_gbps=CM384_DEVICE_GBPS,
        source="docs/paper_figures.md: UBEP latencies 0.22/0.93/2.5 us; CloudMatrix384 >= 392 GB/s per NPU",
    )


def cm_ablation() -> Topology:
    """The UBEP scheduling ablation's machine: 64 devices, four 16-device nodes, tier-2 switch."""
    topo = cm384(devices_per_node=16, num_devices=64)
    return replace(topo, name="cm-ablation")


def nvl72() -> Topology:
    return superpod(
        "nvl72",
        spans=(1, NVL72_DEVICES),
        latency_us=NVLINK5_LATENCY_US[:2],
        device_gbps=NVLINK5_DEVICE_GBPS,
        source="docs/paper_figures.md: NVLink 5, 900 GB/s per GPU, one switch tier; latency assumed",
    )


def nvl576() -> Topology:
    return superpod(
        "nvl576",
        spans=(1, NVL72_DEVICES, NVL72_DEVICES * NVL576_RACKS),
        latency_us=NVLINK5_LATENCY_US,
        device_gbps=NVLINK5_DEVICE_GBPS,
        source="docs/paper_figures.md: NVLink 5, two tiers; latency assumed (no public figure)",
    )


def hgx_h800_ib(num_nodes: int = 32) -> Topology:
    """HGX H800 nodes of 8 GPUs on NVLink, one 400 Gb/s RDMA NIC per GPU between nodes."""
    lat = HGX_LATENCY_US
    levels = (
        Level(name="device", span=1, latency_us=lat[0], port="nvlink"),
        Level(name="node", span=HGX_DEVICES_PER_NODE, latency_us=lat[1], port="nvlink"),
        Level(name="cluster", span=HGX_DEVICES_PER_NODE * num_nodes, latency_us=lat[2], port="rdma"),
    )
    return Topology(
        name="hgx-h800-ib",
        levels=levels,
        ports_gbps=(("nvlink", H800_NVLINK_GBPS), ("rdma", RDMA_NIC_GBPS)),
        source="docs/paper_figures.md: NVLink 150-450 GB/s achieved, ~1-2 us; RDMA ~50 GB/s per NIC, ~2-5 us",
    )


def _numa_nodes(root: Path = Path("/sys/devices/system/node")) -> int:
    nodes = [p for p in root.glob("node[0-9]*")] if root.exists() else []
    return max(1, len(nodes))


def host(
    copy_gbps: float = HOST_COPY_GBPS, cores: int | None = None, numa_nodes: int | None = None
) -> Topology:
    """This machine: one rank per core, cores grouped by NUMA node, memory as the fabric."""
    cores = cores or os.cpu_count() or 1
    numa = numa_nodes or _numa_nodes()
    per_node = cores // numa if cores % numa == 0 else cores
    spans = tuple(sorted({1, per_node, cores}))  # (1,), (1, cores) or (1, per_node, cores)
    topo = superpod("host", spans=spans, latency_us=HOST_LATENCY_US[: len(spans)], device_gbps=copy_gbps)
    return replace(topo, local_copy_gbps=copy_gbps, source="detected cores and NUMA nodes; copy rate given")


PRESETS = ("host", "cm384", "cm-ablation", "nvl72", "nvl576", "hgx-h800-ib")


def preset(name: str) -> Topology:
    makers = {
        "host": host,
        "cm384": cm384,
        "cm-ablation": cm_ablation,
        "nvl72": nvl72,
        "nvl576": nvl576,
        "hgx-h800-ib": hgx_h800_ib,
    }
    if name not in makers:
        raise ValueError(f"topology must be one of {PRESETS} or a JSON file, got {name!r}")
    return makers[name]()


def from_dict(spec: dict) -> Topology:
    """A topology from plain data (the JSON file format; see docs/topology.md); ValueError saying
    what is missing or wrong."""
    if not isinstance(spec, dict):
        raise ValueError(f"a topology is a JSON object, got {type(spec).__name__}")
    if missing := [key for key in ("levels", "ports_gbps") if key not in spec]:
        raise ValueError(f"missing {' and '.join(map(repr, missing))} (the format: docs/topology.md)")
    if not isinstance(spec["ports_gbps"], dict):
        raise ValueError(f"ports_gbps maps port names to GB/s, got {type(spec['ports_gbps']).__name__}")
    try:
        levels = tuple(Level(**lv) for lv in spec["levels"])
    except TypeError as err:  # a level that is not an object, or has unknown or missing fields
        raise ValueError(f"levels: {err}") from None
    return Topology(
        name=spec.get("name", "custom"),
        levels=levels,
        ports_gbps=tuple((str(k), float(v)) for k, v in spec["ports_gbps"].items()),
        local_copy_gbps=float(spec.get("local_copy_gbps", HBM_COPY_GBPS)),
        ranks_per_device=int(spec.get("ranks_per_device", 1)),
        source=spec.get("source", "custom file"),
    )


def load(name_or_path: str) -> Topology:
    """A preset by name, or a custom topology from a JSON file."""
    if name_or_path in PRESETS:
        return preset(name_or_path)
    path = Path(name_or_path)
    if not path.is_file():
        presets = f"{', '.join(PRESETS)} or a JSON file"
        if path.exists() or path.suffix == ".json" or os.sep in name_or_path:  # meant as a file
            missing = "is not a file" if path.exists() else "does not exist"
            raise ValueError(f"topology file {name_or_path} {missing} (a topology is one of {presets})")
        raise ValueError(f"topology must be one of {presets}, got {name_or_path!r}")
    try:
        return from_dict(json.loads(path.read_text()))
    except (OSError, ValueError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"topology file {name_or_path}: {err}") from None

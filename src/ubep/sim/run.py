"""User-facing simulation: a configuration in, dispatch and combine times out.

`simulate(config, protocol)` builds the workload (seeded synthetic routing drawn by
`ubep.routing`), runs the protocol's message pattern on the topology
and returns a `SimResult`. `simulate_host` does the same for this machine with
measured copy bandwidth and per-message overhead (to compare with `ubep bench`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch

from ubep import routing, schedule, topology
from ubep.costmodel import CostParams
from ubep.layout import ExpertPlacement
from ubep.registry import BSP, UBEP
from ubep.sim import hier, protocols
from ubep.topology import Topology

# hidden, routed experts, top-k (docs/paper_figures.md, "MoE workloads")
MODELS = {
    "deepseek-v3": (7168, 256, 8),
    "kimi-k2": (7168, 384, 8),
    "qwen3-235b": (4096, 128, 8),
    "qwen3-30b": (2048, 128, 8),
    "mixtral": (4096, 8, 2),
}
PROTOCOLS = (UBEP.name, "ubep-hier", BSP.name, "deepep-ll")  # ubep-hier: node-level dedup (sim.hier)
OTHER_SYNC = {"ubep-hier": "tff", BSP.name: "stop-and-wait", "deepep-ll": "count signals"}
# Concurrent sender workers per device: Ascend 910 vector cores (the paper's 48), H800 SMs.
DEFAULT_WORKERS = {"cm384": 48, "cm-ablation": 48, "nvl72": 132, "nvl576": 132, "hgx-h800-ib": 132}


@dataclass(frozen=True, kw_only=True, slots=True)
class SimConfig:
    """One simulated configuration (defaults: DeepSeek-V3 decode on CloudMatrix384)."""

    topology: Topology = field(default_factory=topology.cm384)
    ranks: int = 64
    tokens: int = 128  # per rank
    hidden: int = 7168
    experts: int = 256
    topk: int = 8
    dispatch_dtype: str = "bf16"  # or "fp8" (per-128-channel float32 scales)
    routing: str = "uniform"  # routing.ROUTINGS, or "hot" with hot_experts / hot_share
    skew: float = 1.0  # zipf's exponent
    hot_experts: int = 0
    hot_share: float = 0.6
    workers: int | None = None  # None: DEFAULT_WORKERS for the topology, else 32
    seed: int = 0
    params: CostParams = field(default_factory=CostParams)
    policy: str = schedule.DISTANCE  # the scheduler policy of the ubep protocol (ablation)
    sync: str = "tff"  # how ubep's receivers learn that data landed (sim.sync.SYNCS)

    @property
    def num_workers(self) -> int:
        return self.workers or DEFAULT_WORKERS.get(self.topology.name, 32)


@dataclass(frozen=True, kw_only=True, slots=True)
class SimResult:
    protocol: str
    topology: str
    ranks: int
    tokens_per_rank: int
    policy: str
    sync: str
    workers: int
    dispatch_us: float
    combine_us: float
    dispatch_worker_us: float  # slowest sender worker of dispatch
    dispatch_straggler: tuple[int, int]  # that worker: (rank, worker); (-1, -1) where not tracked
    dispatch_straggler_far: float  # share of its bytes bound for its farthest class
    combine_worker_us: float
    dispatch_bytes_per_rank: float  # mean payload bytes one rank sends (per DeepEP's accounting)

    def as_dict(self) -> dict:
        return asdict(self)


def row_bytes(hidden: int, dtype: str) -> int:
    """Bytes of one token row: BF16 2 B per channel; FP8 1 B plus a float32 scale per 128."""
    if dtype == "bf16":
        return 2 * hidden
    if dtype == "fp8":
        return hidden + 4 * (hidden // 128)
    raise ValueError(f"dispatch_dtype must be bf16 or fp8, got {dtype!r}")


def workload(cfg: SimConfig) -> protocols.Workload:
    """Every rank's seeded routing, with experts placed contiguously over the ranks."""
    if cfg.ranks > cfg.topology.num_ranks:
        raise ValueError(f"ranks ({cfg.ranks}) exceeds the topology's {cfg.topology.num_ranks}")
    placement = ExpertPlacement.contiguous(cfg.experts, cfg.ranks)
    return protocols.Workload(
        topk_RNK=route_all(cfg).reshape(cfg.ranks, cfg.tokens, cfg.topk).numpy(),
        owner_E=placement.rank_of_expert_E.numpy(),
        dispatch_row_bytes=row_bytes(cfg.hidden, cfg.dispatch_dtype),
        combine_row_bytes=row_bytes(cfg.hidden, "bf16"),
    )


def route_all(cfg: SimConfig) -> torch.Tensor:
    """int64 [R * N, K]: every rank's top-k, drawn with `ubep.routing` (`cfg.routing` or `hot_experts`)."""
    gen = torch.Generator().manual_seed(cfg.seed)
    X, E, K = cfg.ranks * cfg.tokens, cfg.experts, cfg.topk
    if cfg.hot_experts > 0:
        return routing.hot(X, E, K, num_hot=cfg.hot_experts, hot_share=cfg.hot_share, gen=gen)
    if cfg.routing not in ("uniform", "zipf", "deepseek-groups"):
        raise ValueError(f"routing must be uniform, zipf or deepseek-groups, got {cfg.routing!r}")
    return routing.make(cfg.routing, X, E, K, gen, skew=cfg.skew)


def simulate(cfg: SimConfig, protocol: str, wl: protocols.Workload | None = None) -> SimResult:
    """Dispatch and combine of one protocol on one configuration."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    wl = wl or workload(cfg)
    topo, p, W = cfg.topology, cfg.params, cfg.num_workers
    if protocol == "deepep-ll":
        d, c = (protocols.deepep_ll(wl, topo, p, W, combine=flag) for flag in (False, True))
        sent = (wl.topk_RNK >= 0).sum() / wl.num_ranks * wl.dispatch_row_bytes
    else:
        disp, comb = {UBEP.name: (protocols.ubep_dispatch, protocols.ubep_combine),
                      "ubep-hier": (hier.hier_dispatch, hier.hier_combine),
                      BSP.name: (protocols.bsp_dispatch, protocols.bsp_combine)}[protocol]  # fmt: skip
        policy = protocols.BSP_SEND_POLICY if protocol == BSP.name else cfg.policy
        if protocol == UBEP.name:
            d, c = disp(wl, topo, p, W, policy, cfg.sync), comb(wl, topo, p, W, policy, cfg.sync)
        else:
            d, c = disp(wl, topo, p, W, policy), comb(wl, topo, p, W, policy)
        sent = wl.counts_RR().sum() / wl.num_ranks * wl.dispatch_row_bytes
        if protocol == "ubep-hier":  # node peers directly, one row per remote node (to its relay)
            sent = hier.sent_counts(wl, topo).sum() / wl.num_ranks * wl.dispatch_row_bytes
    return SimResult(
        protocol=protocol,
        topology=topo.name,
        ranks=cfg.ranks,
        tokens_per_rank=cfg.tokens,
        policy=schedule.policy_name(cfg.policy) if protocol == UBEP.name else protocol,
        sync=cfg.sync if protocol == UBEP.name else OTHER_SYNC[protocol],
        workers=W,
        dispatch_us=d.latency_us + p.call_us,
        combine_us=c.latency_us + p.call_us,
        dispatch_worker_us=d.worker_us,
        dispatch_straggler=d.straggler,
        dispatch_straggler_far=d.straggler_far,
        combine_worker_us=c.worker_us,
        dispatch_bytes_per_rank=float(sent),
    )


def simulate_host(
    copy_gbps: float,
    msg_overhead_us: float,
    *,
    ranks: int,
    tokens: int,
    protocol: str = UBEP.name,
    **config,
) -> SimResult:
    """This machine, with `ubep bench`'s measured copy rate (GB/s) and per-message overhead (us).

    One rank per core, one worker per rank; cores beyond the detected count are
    modelled as more cores of the same NUMA layout.
    """
    cores = max(ranks, topology.host().num_devices)
    topo = topology.host(copy_gbps=copy_gbps, cores=cores)
    params = replace(CostParams(), msg_overhead_us=msg_overhead_us, link_efficiency=1.0)
    cfg = SimConfig(topology=topo, ranks=ranks, tokens=tokens, params=params, workers=1, **config)
    return simulate(cfg, protocol)


def mean_reduction(base: list[float], new: list[float]) -> float:
    """Mean relative reduction of `new` against `base`, in percent."""
    b, n = np.asarray(base), np.asarray(new)
    return float(np.mean((b - n) / b) * 100)

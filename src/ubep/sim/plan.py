"""`ubep plan`: advice for a user's own fabric, from the simulator.

Given a topology and a model, it tries the choices a deployment makes and keeps
the fastest (dispatch + combine, at the largest batch), in this order:

  protocol  ubep, ubep-hier (node-level dedup; only where a slower port joins nodes), bsp
  sync      tff, dc, sp (stop-and-wait is the baseline, never advised)
  policy    distance (distance-aware) or balanced; on a one-tier fabric they tie (within 1%)
  workers   the fewest workers within 3% of the best (more only add contention)

then predicts dispatch and combine for every batch and names the bottleneck of
each: the busiest port or uplink (its busy time against the phase's data time),
or the slowest worker when it, not a port, sets the pace (which one, and how much
of its traffic goes far), or, when nothing saturates, the chain of latencies,
synchronization and the fixed call cost.

Legend: R ranks, C distance classes. Times in us.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from ubep.costmodel import CostParams, port_gbps_C
from ubep.registry import BSP, UBEP
from ubep.schedule import BALANCED, DISTANCE
from ubep.sim import hier
from ubep.sim.run import MODELS, SimConfig, SimResult, simulate, workload
from ubep.sim.sync import DATA_AS_FLAG, reorder_factor
from ubep.topology import Topology

WORKER_CHOICES = (4, 8, 16, 24, 32, 48, 64, 96, 132)
WORKERS_WITHIN = 0.03  # fewest workers within 3% of the best
POLICY_TIE = 0.01  # policies within 1% of each other: the fabric has no distance worth exploiting
BUSY = 0.6  # a port (or worker) busy for >= 60% of the phase's data time is "the" bottleneck
Progress = Callable[[str], None]  # told what is simulated next (a default plan takes ~30 s on 2 cores)


def _quiet(step: str) -> None:
    """The default Progress: say nothing."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Advice:
    """The choices, and per kind of choice what each candidate took: dispatch + combine at `tokens`
    tokens per rank (us), in `reasons` lines such as "protocol: ubep 173.5 us, bsp 303.6 us"."""

    tokens: int
    protocol: str
    sync: str
    policy: str
    workers: int
    reasons: tuple[str, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Prediction:
    tokens: int
    dispatch_us: float
    combine_us: float
    bottleneck: str


def _total(r: SimResult) -> float:
    return r.dispatch_us + r.combine_us


def _best(
    cfg: SimConfig, wl, choices: dict[str, tuple[str, SimConfig]], what: str, progress: Progress
) -> tuple[str, dict[str, float]]:
    times = {}
    for name, (proto, c) in choices.items():
        progress(f"{what} {name}")
        times[name] = _total(simulate(c, proto, wl))
    return min(times, key=times.get), times


def _has_slow_network(topo: Topology) -> bool:
    gbps = topo.port_gbps_C()
    return topo.num_classes > 2 and gbps[-1] < gbps[1]


def advise(base: SimConfig, progress: Progress = _quiet) -> Advice:
    """The protocol, sync variant, scheduler policy and worker count for `base` (at its batch)."""
    wl, reasons = workload(base), []
    protos = (UBEP.name, "ubep-hier", BSP.name) if _has_slow_network(base.topology) else (UBEP.name, BSP.name)
    proto, t = _best(base, wl, {p: (p, base) for p in protos}, "protocol", progress)
    reasons.append("protocol: " + ", ".join(f"{p} {v:.1f} us" for p, v in t.items()))
    sync = "tff"
    if proto == UBEP.name:
        syncs = {s: (UBEP.name, replace(base, sync=s)) for s in DATA_AS_FLAG}
        sync, t = _best(base, wl, syncs, "sync", progress)
        reasons.append("sync: " + ", ".join(f"{s} {v:.1f} us" for s, v in t.items()))
    cfg = replace(base, sync=sync)
    policies = {p: (proto, replace(cfg, policy=p)) for p in (DISTANCE, BALANCED)}
    policy, t = _best(cfg, wl, policies, "policy", progress)
    if abs(t[DISTANCE] - t[BALANCED]) <= POLICY_TIE * t[DISTANCE]:
        policy = DISTANCE
        reasons.append(f"policy: {DISTANCE} and {BALANCED} tie within 1% (no distance to exploit here)")
    else:
        reasons.append("policy: " + ", ".join(f"{p} {v:.1f} us" for p, v in t.items()))
    cfg = replace(cfg, policy=policy)
    most = base.num_workers
    counts = sorted({w for w in WORKER_CHOICES if w <= most} | {most})
    choices = {str(w): (proto, replace(cfg, workers=w)) for w in counts}
    w_t = {int(w): v for w, v in _best(cfg, wl, choices, "workers per rank:", progress)[1].items()}
    best = min(w_t.values())
    workers = min(w for w, v in w_t.items() if v <= best * (1 + WORKERS_WITHIN))
    reasons.append("workers per rank: " + ", ".join(f"{v:.1f} us at {w}" for w, v in w_t.items()))
    return Advice(
        tokens=base.tokens, protocol=proto, sync=sync, policy=policy, workers=workers, reasons=tuple(reasons)
    )


def port_busy_us(cfg: SimConfig, protocol: str) -> dict[str, float]:
    """The busiest injection and ejection port of each kind, and capped uplink, in dispatch (us busy).

    From the bytes each rank sends and receives per distance class (with TFF's tax), over
    the port's achievable rate: a port busy for most of the phase is its bottleneck.
    """
    topo, wl = cfg.topology, workload(cfg)
    R = wl.num_ranks
    counts = hier.sent_counts(wl, topo) if protocol == "ubep-hier" else wl.counts_RR()
    bytes_RR = counts * wl.dispatch_row_bytes * reorder_factor(cfg.sync if protocol == UBEP.name else "tff")
    cls_RR = topo.class_matrix(R)
    rate_C = port_gbps_C(topo, cfg.params) * 1e3
    out: dict[str, float] = {}
    for c in range(1, topo.num_classes):
        port = topo.levels[c].port
        busy = np.where(cls_RR == c, bytes_RR, 0.0) / rate_C[c]
        for side, axis in (("injection", 1), ("ejection", 0)):
            key = f"{side} port '{port}'"
            out[key] = max(out.get(key, 0.0), float(busy.sum(axis=axis).max()))
    for lv, level in enumerate(topo.levels[1:], start=1):
        if level.uplink_gbps is None:
            continue
        dom = topo.device_of(np.arange(R)) // level.span
        leaving = np.where(cls_RR > lv, bytes_RR, 0.0)
        per_dom = np.bincount(dom, weights=leaving.sum(axis=1))
        rate = cfg.params.link_efficiency * level.uplink_gbps * 1e3
        out[f"'{level.name}' uplink"] = float(per_dom.max() / rate)
    return out


def bottleneck(cfg: SimConfig, protocol: str, r: SimResult) -> str:
    """Which port or uplink saturates, which worker straggles, or the fixed costs."""
    data_us = r.dispatch_us - cfg.params.call_us
    busy = port_busy_us(cfg, protocol)
    name, us = max(busy.items(), key=lambda kv: kv[1]) if busy else ("", 0.0)
    if us >= BUSY * data_us:
        return f"{name} ({us:.1f} us busy of {data_us:.1f})"
    if r.dispatch_worker_us >= BUSY * data_us:
        rank, worker = r.dispatch_straggler
        took, far = r.dispatch_worker_us, r.dispatch_straggler_far
        return (f"worker {worker} of rank {rank} straggles ({took:.1f} us of {data_us:.1f}, {far:.0%} of "
                f"its bytes to its farthest class; ports <= {us:.1f} us busy)")  # fmt: skip
    worker, call = r.dispatch_worker_us, cfg.params.call_us
    return (f"nothing saturates (ports <= {us:.1f} us, workers <= {worker:.1f} us busy of {data_us:.1f}): "
            f"latencies, synchronization, reorder, and the {call:.1f} us call")  # fmt: skip


def plan(
    topo: Topology,
    *,
    model: str = "deepseek-v3",
    ranks: int | None = None,
    batches: tuple[int, ...] = (8, 16, 32, 64, 128),
    params: CostParams | None = None,
    dispatch_dtype: str = "bf16",
    progress: Progress = _quiet,
) -> tuple[Advice, list[Prediction]]:
    """Advice at the largest batch, then predictions with bottlenecks for every batch.

    `ranks` defaults to the most ranks of the topology that divide the model's experts;
    `progress` is told each simulation before it runs.
    """
    if model not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {model!r}")
    hidden, experts, topk = MODELS[model]
    R = ranks or max(r for r in range(1, min(topo.num_ranks, experts) + 1) if experts % r == 0)
    if experts % R or R > topo.num_ranks:
        raise ValueError(f"ranks ({R}) must divide the model's {experts} experts and fit the topology")
    base = SimConfig(topology=topo, ranks=R, tokens=max(batches), hidden=hidden, experts=experts, topk=topk,
                     dispatch_dtype=dispatch_dtype, params=params or CostParams())  # fmt: skip
    advice = advise(base, progress)
    cfg = replace(base, sync=advice.sync, policy=advice.policy, workers=advice.workers)
    preds = []
    for n in batches:
        progress(f"prediction at {n} tokens per rank")
        c = replace(cfg, tokens=n)
        r = simulate(c, advice.protocol)
        preds.append(Prediction(tokens=n, dispatch_us=r.dispatch_us, combine_us=r.combine_us,
                                bottleneck=bottleneck(c, advice.protocol, r)))  # fmt: skip
    return advice, preds

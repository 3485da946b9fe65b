"""Racks of hosts of ranks on the fabric model: the bytes each schedule puts on each tier, and the
simulator's time for it, beside `ubep bench --hosts N --racks Q` (docs/benchmarks.md).

A schedule is the way of each (token, destination rank) pair, as waypoints; a hop carries a token
once per distinct (waypoint, next waypoint) (that is the dedup):

    dist   s -> d                                   every peer directly (flat)
    hier   s -> l(s) on d's host -> d               once per host (two tiers, `ubep.across.ubep_hier`)
    tiers  s -> s's place in d's rack -> l(s) on d's host -> d
                                                    once per rack, then per host (`ubep.across.ubep_tiers`)

(l(s): the rank with s's local index; a waypoint equal to the last is no hop.) Each hop is
between ranks of one host (memory), of one rack (the fast tier: the hosts' links) or of two racks
(the slow tier: the racks' uplinks as well). Combine runs the hops backwards.

The time: each hop's blocks (one message per (sender, receiver) a call) on `ubep.sim.engine`, a
relay sending once all of its blocks of the hop before have landed; every hop so far is simulated
together, so later hops share the ports with earlier ones (as `ubep.sim.hier` does). The machine
(`stack_topology`): a host's ranks share its link (a host-level uplink at the link's rate), a
rack's hosts share its uplink (a rack-level uplink at the slow tier's rate).

Legend: R ranks, N tokens per rank, K top-k, P ranks per host, J hosts per rack, Q racks, A pairs.
Times in us, rates in GB/s.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from ubep.costmodel import CostParams, copy_us
from ubep.registry import DIST, HIER, TIERS
from ubep.sim import engine
from ubep.topology import HOST_COPY_GBPS, HOST_LATENCY_US, Level, Topology

# the schedules, by the transport that runs each: flat (dist), per host (hier), per rack then host (tiers)
SCHEDULES = (DIST.name, HIER.name, TIERS.name)
TIER_NAMES = ("memory", "fast", "slow")  # within a host, between hosts of a rack, between racks


@dataclass(frozen=True, kw_only=True, slots=True)
class Stack:
    """Q racks of J hosts of P ranks (ranks numbered host by host, hosts rack by rack), and its links."""

    racks: int
    hosts_per_rack: int
    ranks_per_host: int
    link_gbps: float  # each host's link (GB/s)
    rack_gbps: float  # each rack's uplink (GB/s)
    delay_us: float = 15.0  # one way, between hosts

    @property
    def num_ranks(self) -> int:
        return self.racks * self.hosts_per_rack * self.ranks_per_host

    def place(self, ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rack, host within the rack, local index) of each rank."""
        host, local = np.divmod(ranks, self.ranks_per_host)
        rack, j = np.divmod(host, self.hosts_per_rack)
        return rack, j, local

    def rank(self, rack, j, local) -> np.ndarray:
        return (rack * self.hosts_per_rack + j) * self.ranks_per_host + local

    def tier(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """int64 index into TIER_NAMES of each hop src -> dst."""
        (qs, js, _), (qd, jd, _) = self.place(src), self.place(dst)
        return np.where(qs != qd, 2, np.where(js != jd, 1, 0))


def stack_topology(stack: Stack, copy_gbps: float = HOST_COPY_GBPS) -> Topology:
    """The stack as a `Topology`: memory within a host, each host's link capped at link_gbps, each
    rack's uplink at rack_gbps."""
    P, J = stack.ranks_per_host, stack.hosts_per_rack
    lat = HOST_LATENCY_US
    levels = [Level(name="device", span=1, latency_us=lat[0], port="memory")]
    if P > 1:
        levels.append(
            Level(name="host", span=P, latency_us=lat[1], port="memory", uplink_gbps=stack.link_gbps)
        )
    if J > 1:
        levels.append(Level(name="rack", span=P * J, latency_us=stack.delay_us, port="link",
                            uplink_gbps=stack.rack_gbps))  # fmt: skip
    levels.append(Level(name="racks", span=stack.num_ranks, latency_us=stack.delay_us, port="link"))
    return Topology(
        name=f"racks-{stack.racks}x{J}x{P}",
        levels=tuple(levels),
        ports_gbps=(
            ("memory", copy_gbps),
            ("link", stack.link_gbps if J > 1 else min(stack.link_gbps, stack.rack_gbps)),
        ),
        local_copy_gbps=copy_gbps,
        source="namespace hosts: tc's link and uplink rates; memory at the host copy rate (assumed)",
    )


def waypoints(schedule: str, stack: Stack, src: np.ndarray, dst: np.ndarray) -> list[np.ndarray]:
    """The ranks each (source, destination) pair passes, first the source, last the destination."""
    qs, js, ls = stack.place(src)
    qd, jd, _ = stack.place(dst)
    if schedule == DIST.name:
        return [src, dst]
    if schedule == HIER.name:
        host_d = qd * stack.hosts_per_rack + jd
        return [src, host_d * stack.ranks_per_host + ls, dst]
    if schedule == TIERS.name:
        holder = np.where(qs == qd, src, stack.rank(qd, js, ls))
        return [src, holder, stack.rank(qd, jd, ls), dst]
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")


def hop_rows(schedule: str, stack: Stack, hit_RNR: np.ndarray) -> list[np.ndarray]:
    """int64 [R, R] per hop: rows each rank sends each rank on that hop of a dispatch (a token once
    per distinct (sender, receiver) of the hop; the diagonal: rows a rank keeps)."""
    R = stack.num_ranks
    s, n, d = np.nonzero(hit_RNR)
    points = waypoints(schedule, stack, s, d)
    out = []
    for a, b in pairwise(points):
        keys = np.unique(np.stack([s, n, a, b]), axis=1)
        rows_RR = np.zeros((R, R), dtype=np.int64)
        np.add.at(rows_RR, (keys[2], keys[3]), 1)
        out.append(rows_RR)
    return out


def row_bytes(schedule: str, hidden: int, itemsize: int, topk: int) -> tuple[list[int], list[int]]:
    """(dispatch, combine) bytes of one row on each hop, as the protocols send them: routing beside
    a crossing row (dist: `ubep_flat.meta_bytes`; hier and tiers: source token, ids, weights, and on
    the tiers' second hop the source rank), float32 partials back across hosts, x's dtype in memory."""
    B, meta = hidden * itemsize, 8 + 12 * topk
    if schedule == DIST.name:
        return [B + 8 * (1 + 2 * topk)], [B]
    if schedule == HIER.name:
        return [B + meta, B], [4 * hidden, B]
    return [B + meta, B + 8 + meta, B], [4 * hidden, 4 * hidden, B]


def tier_bytes(
    schedule: str, stack: Stack, hit_RNR: np.ndarray, hidden: int, itemsize: int, topk: int
) -> dict:
    """Bytes of one call (dispatch and combine, every rank) on each tier: {"memory", "fast", "slow"}."""
    out = dict.fromkeys(TIER_NAMES, 0)
    down, up = row_bytes(schedule, hidden, itemsize, topk)
    for rows_RR, b_down, b_up in zip(hop_rows(schedule, stack, hit_RNR), down, up, strict=True):
        src, dst = np.nonzero(rows_RR)
        tier_A = stack.tier(src, dst)
        for t, name in enumerate(TIER_NAMES):
            out[name] += int(rows_RR[src, dst][tier_A == t].sum()) * (b_down + b_up)
    return out


def _simulate_hops(blocks: list[tuple[np.ndarray, int]], topo: Topology, params: CostParams) -> float:
    """us until the last block of the last hop lands: each hop's blocks (rows [R, R], row bytes) sent
    once their sender's blocks of the hop before landed; hops so far share the fabric."""
    R = topo.num_ranks
    landed_R = np.zeros(R)  # when each rank holds what the hop before brought it
    parts: list[engine.Messages] = []
    timing = None
    for rows_RR, nbytes in blocks:
        src, dst = np.nonzero(rows_RR)
        parts.append(engine.Messages(
            src_Z=src, dst_Z=dst, worker_Z=np.zeros_like(src), seq_Z=np.arange(src.size) + 1e6 * len(parts),
            bytes_Z=rows_RR[src, dst] * nbytes, ready_Z=landed_R[src],
        ))  # fmt: skip
        timing = engine.simulate(engine.concat(parts), topo, CostParams() if params is None else params, 1)
        last = parts[-1]
        arrived = timing.arrived_Z[-last.size :] if last.size else np.zeros(0)
        landed_R = np.zeros(R)
        np.maximum.at(landed_R, last.dst_Z, arrived + copy_us(topo, last.bytes_Z))
    return float(landed_R.max()) if timing is not None else 0.0


def predict_us(schedule: str, stack: Stack, hit_RNR: np.ndarray, hidden: int, itemsize: int, topk: int,
               params: CostParams | None = None) -> tuple[float, float]:  # fmt: skip
    """(dispatch, combine) us of one call on the stack's model, every rank at once."""
    topo, params = stack_topology(stack), params or CostParams()
    hops = hop_rows(schedule, stack, hit_RNR)
    down, up = row_bytes(schedule, hidden, itemsize, topk)
    dispatch = _simulate_hops(list(zip(hops, down, strict=True)), topo, params)
    back = [(rows_RR.T, b) for rows_RR, b in zip(hops[::-1], up[::-1], strict=True)]
    return dispatch, _simulate_hops(back, topo, params)

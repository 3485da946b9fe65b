"""Node-level dedup (the hierarchical transport) on the fabric model: protocol "ubep-hier".

On a machine whose nodes are joined by a slower port (HGX + RDMA), a token bound
for several ranks of one remote node crosses the network once: rank s sends it to
its *relay* on that node (the rank with s's local index, as DeepEP's normal mode
does), and the relay forwards it over the node's fast port to each destination
rank there. Ranks of s's own node get it directly. Combine mirrors it: partial
rows go to the relay over the fast port, the relay sums the rows of each token and
sends one row per token home over the network.

  dispatch  pass 1: s's pieces (ubep's scheduler over relays and node peers), TFF,
            beside the routing headers; pass 2: the same plus one forward message
            per (s, d) for each remote pair, relay -> d, ready when s's block landed
            at the relay (pass 1), so both share the ports. Forwards go on the
            relay's W // 8 forwarder workers (each block split among them), which
            send nothing else.
  combine   pass 1: every (d, s) partial block, to s if d is s's node peer, else to
            s's relay on d's node; pass 2: the same plus, per (relay, s), one summed
            block home, ready when all of its partial blocks landed and were reduced.

Legend: R ranks, V ranks per node, G nodes, X = R * N tokens (all ranks). Times in us.
"""

from __future__ import annotations

import numpy as np
import torch

from ubep import schedule
from ubep.costmodel import CostParams, copy_us
from ubep.layout import ExpertPlacement, token_in_rank
from ubep.sim import engine, sync
from ubep.sim.engine import pair_max
from ubep.sim.protocols import PhaseTime, Workload, count_workers, msgs, phase, pieces, reorder
from ubep.topology import Topology


def forwarders(workers: int) -> int:
    """Workers of each rank kept for relaying (DeepEP's normal mode also splits senders and forwarders)."""
    return max(1, workers // 8)


def spread(src, dst, nbytes, ready, first_worker: int, fw: int):
    """Messages split into `fw` equal chunks, one per forwarder worker (rotated by destination),
    so one relay's big block is not left to one window-bound worker. -> (Messages, index of the
    original message of each chunk)."""
    n = np.asarray(src).size
    orig = np.repeat(np.arange(n), fw)
    chunk = np.tile(np.arange(fw), n)
    nb = np.asarray(nbytes, dtype=np.int64)[orig]
    size = nb // fw + (chunk < nb % fw)
    keep = size > 0
    worker = first_worker + (chunk + np.asarray(dst)[orig]) % fw
    m = msgs(np.asarray(src)[orig][keep], np.asarray(dst)[orig][keep], worker[keep], orig[keep],
             size[keep], np.asarray(ready, dtype=float)[orig][keep])  # fmt: skip
    return m, orig[keep]


def ranks_per_node(topo: Topology, num_ranks: int) -> int:
    """V: ranks in one domain of the first level above a device (an HGX node); on a one-tier
    machine every rank is on one node and dedup reduces to ubep."""
    V = topo.levels[1].span * topo.ranks_per_device if topo.num_classes > 2 else num_ranks
    V = min(V, num_ranks)
    if num_ranks % V:
        raise ValueError(f"ubep-hier: ranks ({num_ranks}) must fill whole nodes of {V} ranks")
    return V


def node_counts(wl: Workload, V: int) -> tuple[np.ndarray, np.ndarray]:
    """(counts_RR, relay_RR): tokens s sends to d (once per rank), and to d as s's relay on d's node
    (once per node, in the column of the relay: d = node * V + s % V; zero on s's own node)."""
    R, N, K = wl.topk_RNK.shape
    placement = ExpertPlacement.from_ranks(torch.from_numpy(wl.owner_E), R)
    hit_RNR = token_in_rank(torch.from_numpy(wl.topk_RNK).reshape(R * N, K), placement).reshape(R, N, R)
    counts_RR = hit_RNR.sum(dim=1).numpy().astype(np.int64)
    per_node_RG = hit_RNR.reshape(R, N, R // V, V).any(dim=3).sum(dim=1).numpy().astype(np.int64)
    relay_RR = np.zeros((R, R), dtype=np.int64)
    s, b = np.meshgrid(np.arange(R), np.arange(R // V), indexing="ij")
    remote = b != s // V
    relay_RR[s[remote], (b * V + s % V)[remote]] = per_node_RG[remote]
    return counts_RR, relay_RR


def split(counts_RR: np.ndarray, V: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(local_RR, remote pair src, remote pair dst): the node-local part of counts and the remote pairs."""
    R = counts_RR.shape[0]
    same_RR = (np.arange(R)[:, None] // V) == (np.arange(R)[None, :] // V)
    src, dst = np.nonzero(~same_RR & (counts_RR > 0))
    return np.where(same_RR, counts_RR, 0), src, dst


def sent_counts(wl: Workload, topo: Topology) -> np.ndarray:
    """int64 [R, R]: rows each rank puts on the wire to each rank: node peers and relays."""
    V = ranks_per_node(topo, wl.num_ranks)
    counts, relay_RR = node_counts(wl, V)
    return split(counts, V)[0] + relay_RR


def hier_dispatch(
    wl: Workload, topo: Topology, params: CostParams, workers: int, policy: str = schedule.DISTANCE
) -> PhaseTime:
    """Dispatch with node-level dedup: node peers directly, other nodes through relays."""
    R = wl.num_ranks
    V = ranks_per_node(topo, R)
    counts, relay_RR = node_counts(wl, V)
    local, rs, rd = split(counts, V)
    relay = rd // V * V + rs % V
    cw, fw, row = count_workers(workers), forwarders(workers), wl.dispatch_row_bytes
    sched = schedule.plan(local + relay_RR, topo, workers=max(1, workers - cw - fw), row_bytes=row,
                          policy=policy, params=params)  # fmt: skip
    first = pieces(sched, np.zeros(R), worker_offset=cw)
    src, rot = np.divmod(np.arange(R * R), R)
    dst = (src + 1 + rot) % R
    hdr = msgs(src, dst, rot % max(cw, 1), rot, params.flag_bytes + 8 * counts[src, dst], 0.0)
    args = dict(num_ranks=R, row_bytes=row, capacity_rows=R * wl.tokens)
    landed_RR = sync.deliver("tff", first, hdr, topo, params, workers, **args).usable_RR
    fwd, pair = spread(relay, rd, counts[rs, rd] * row, landed_RR[rs, relay], workers - fw, fw)
    d = sync.deliver("tff", engine.concat([first, fwd]), hdr, topo, params, workers, **args)
    usable_Z = d.data.arrived_Z + params.poll_us
    ready_RR = pair_max(first.src_Z, first.dst_Z, usable_Z[: first.size], R) * (local > 0)
    np.maximum.at(ready_RR, (rs[pair], rd[pair]), usable_Z[first.size :])
    ready_RR = np.maximum(ready_RR, pair_max(src, dst, d.extra.arrived_Z, R) + params.prefix_us)
    done = reorder(ready_RR, counts, row * d.reorder_factor, topo, by_rank=False)
    return phase(done, first, d.data.injected_Z[: first.size], topo)


def hier_combine(
    wl: Workload, topo: Topology, params: CostParams, workers: int, policy: str = schedule.DISTANCE
) -> PhaseTime:
    """Combine with node-level dedup: partial rows summed at the relay, one row per token home."""
    R = wl.num_ranks
    V = ranks_per_node(topo, R)
    counts, relay_RR = node_counts(wl, V)
    local, rs, rd = split(counts, V)  # rows go back from rd (expert side) to rs (home)
    relay = rd // V * V + rs % V
    row, fw = wl.combine_row_bytes, forwarders(workers)
    senders = max(1, workers - fw)
    sched = schedule.plan(local.T, topo, workers=senders, row_bytes=row, policy=policy, params=params)
    direct = pieces(sched, np.zeros(R), worker_offset=0)
    partial = msgs(rd, relay, rs % senders, R + rs, counts[rs, rd] * row, 0.0)
    none = msgs(np.zeros(0), np.zeros(0), 0, 0, 0, 0.0)
    args = dict(num_ranks=R, row_bytes=row, capacity_rows=R * wl.tokens)
    first = sync.deliver("tff", engine.concat([direct, partial]), none, topo, params, workers, **args)
    part_at_Z = first.data.arrived_Z[direct.size :] + params.poll_us
    reduced_RR = np.zeros((R, R))  # [relay, home]: every partial block summed
    np.maximum.at(reduced_RR, (relay, rs), part_at_Z)
    hs, hr = np.nonzero(relay_RR.T > 0)  # relay hs sends home to hr
    partial_rows_RR = np.zeros((R, R))
    np.add.at(partial_rows_RR, (relay, rs), counts[rs, rd])
    ready = reduced_RR[hs, hr] + copy_us(topo, partial_rows_RR[hs, hr] * row)  # read every partial row
    home, _ = spread(hs, hr, relay_RR[hr, hs] * row, ready, workers - fw, fw)
    d = sync.deliver("tff", engine.concat([direct, partial, home]), none, topo, params, workers, **args)
    n_direct, n_part = direct.size, partial.size
    usable_Z = d.data.arrived_Z + params.poll_us
    ready_RR = pair_max(direct.src_Z, direct.dst_Z, usable_Z[:n_direct], R)
    ready_RR = np.maximum(ready_RR, pair_max(home.src_Z, home.dst_Z, usable_Z[n_direct + n_part :], R))
    rows_RR = local.T + relay_RR.T
    done = reorder(ready_RR, rows_RR, row * d.reorder_factor, topo, by_rank=True)
    return phase(done, engine.concat([direct, partial, home]), d.data.injected_Z, topo)

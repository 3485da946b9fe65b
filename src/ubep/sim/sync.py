"""How a receiver learns that a block of data has landed: the synchronization variants as plans.

A *block* is everything one sender puts to one receiver in one call (one or more
pieces, possibly from several workers). Each variant is a message pattern with
its own costs (the UBEP paper's Data-as-Flag, docs/paper_figures.md; constants in costmodel.py):

  tff            flag fused into every 512 B write (32 B flag + 480 B payload): the
                 payload travels 512/480 = 1.067x larger (the 6.25% tax), the receiver
                 checks the last write's flag (one poll) and copies the wire bytes.
  dc             plain payload; the sender folds the block into a checksum (one read
                 pass over its bytes, on the worker, after the data) and, once the
                 block's last piece is issued, writes one checksum word; the receiver
                 polls it, then validates (one more read pass before the reorder copy).
  sp             plain payload; the receiver first pre-fills a sentinel line in each of
                 its receive slots (capacity rows x 64 B, at the local copy rate), data
                 may land only after that; the receiver polls the last word of the block.
  stop-and-wait  plain payload, then a fence: the worker waits for the write's
                 acknowledgement (a round trip), then writes a flag that the receiver
                 polls. The baseline: every row pays the round trip and a flag write
                 (the same per-row readiness that TFF's per-write flags give for free);
                 a piece of k rows is one message held k round trips plus k flags.

`deliver` times a set of data pieces under one variant on the fabric model
(sharing it with any `extra` messages, e.g. ubep's routing headers) and returns
when each (sender, receiver) block becomes usable, and how many bytes per payload
byte the receiver's reorder reads.

Legend: R ranks, Z messages; an [R, R] array is sender x receiver. Times in us.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import pairwise

import numpy as np

from ubep.costmodel import (
    SENTINEL_BYTES,
    TFF_FLAG_BYTES,
    TFF_WRITE_BYTES,
    CostParams,
    copy_us,
)
from ubep.sim import engine
from ubep.sim.engine import Messages, pair_max
from ubep.topology import Topology

SYNCS = ("tff", "dc", "sp", "stop-and-wait")
DATA_AS_FLAG = ("tff", "dc", "sp")


@dataclass(frozen=True, kw_only=True, slots=True)
class Delivery:
    """When each block is usable by its receiver, and what the fabric did with every message."""

    usable_RR: np.ndarray  # float [R, R]: receiver may consume sender s's block (0 where none)
    extra: engine.Timing  # timing of the `extra` messages, in their order
    data: engine.Timing  # timing of the payload messages, in their order
    reorder_factor: float  # bytes the receiver's reorder reads per payload byte


def wire_bytes(sync: str, nbytes: np.ndarray) -> np.ndarray:
    """Bytes on the wire for payloads of `nbytes`: TFF packs 480 B of payload per 512 B write."""
    if sync != "tff":
        return np.asarray(nbytes, dtype=np.int64)
    payload = TFF_WRITE_BYTES - TFF_FLAG_BYTES
    return -(-np.asarray(nbytes, dtype=np.int64) // payload) * TFF_WRITE_BYTES


def reorder_factor(sync: str) -> float:
    """Read passes of the receiver per payload byte: TFF copies the wire bytes, DC validates first."""
    return {"tff": TFF_WRITE_BYTES / (TFF_WRITE_BYTES - TFF_FLAG_BYTES), "dc": 2.0}.get(sync, 1.0)


def _flags(data: Messages, seq_Z: np.ndarray, ready_Z: np.ndarray, params: CostParams) -> Messages:
    n = data.size
    return Messages(src_Z=data.src_Z, dst_Z=data.dst_Z, worker_Z=data.worker_Z, seq_Z=seq_Z,
                    bytes_Z=np.full(n, params.flag_bytes, dtype=np.int64), ready_Z=ready_Z,
                    hold_us_Z=np.zeros(n))  # fmt: skip


def _run(parts: list[Messages], topo: Topology, params: CostParams, workers: int) -> list[engine.Timing]:
    """Simulate the concatenation of `parts`; split the timing back per part."""
    t = engine.simulate(engine.concat(parts), topo, params, workers)
    cuts = np.cumsum([0] + [p.size for p in parts])
    fields = ("cls_Z", "issued_Z", "injected_Z", "arrived_Z")
    return [engine.Timing(**{f: getattr(t, f)[a:b] for f in fields}) for a, b in pairwise(cuts)]


def _dc_trailers(data: Messages, issued_Z: np.ndarray, R: int, params: CostParams) -> Messages:
    """One checksum per (sender, receiver), from the worker of the block's last-issued piece."""
    pair = data.src_Z * R + data.dst_Z
    order = np.lexsort((issued_Z, pair))
    last = order[np.r_[pair[order][1:] != pair[order][:-1], True]]
    n = last.size
    return Messages(src_Z=data.src_Z[last], dst_Z=data.dst_Z[last], worker_Z=data.worker_Z[last],
                    seq_Z=np.full(n, np.inf), bytes_Z=np.full(n, params.flag_bytes, dtype=np.int64),
                    ready_Z=issued_Z[last], hold_us_Z=np.zeros(n))  # fmt: skip


def deliver(
    sync: str,
    data: Messages,
    extra: Messages,
    topo: Topology,
    params: CostParams,
    workers: int,
    *,
    num_ranks: int,
    row_bytes: int,
    capacity_rows: int,
) -> Delivery:
    """Time `data` (plain payload pieces, in worker order by `seq_Z`) under `sync`, beside `extra`."""
    if sync not in SYNCS:
        raise ValueError(f"sync must be one of {SYNCS}, got {sync!r}")
    R = num_ranks
    payload = data.bytes_Z
    wire = replace(data, bytes_Z=wire_bytes(sync, payload), seq_Z=2 * np.asarray(data.seq_Z, dtype=float))
    lat_Z = topo.latency_C()[topo.distance_class(data.src_Z, data.dst_Z)]
    if sync == "stop-and-wait":  # per row: fence (the write's ack comes back), then the flag
        rows_Z = -(-payload // row_bytes)
        wire = replace(wire, hold_us_Z=rows_Z * (2 * lat_Z + params.msg_overhead_us))
        flags = replace(
            _flags(data, wire.seq_Z + 1, data.ready_Z, params), bytes_Z=rows_Z * params.flag_bytes
        )
        t_extra, t_data, t_flag = _run([extra, wire, flags], topo, params, workers)
        ready_Z = np.maximum(t_data.arrived_Z, t_flag.arrived_Z)
    elif sync == "dc":  # checksum pass on the worker after the data, then one trailer per block
        wire = replace(wire, hold_us_Z=copy_us(topo, payload))
        _, first = _run([extra, wire], topo, params, workers)
        trailers = _dc_trailers(wire, first.issued_Z, R, params)
        t_extra, t_data, t_tail = _run([extra, wire, trailers], topo, params, workers)
        tail_RR = pair_max(trailers.src_Z, trailers.dst_Z, t_tail.arrived_Z, R)
        ready_Z = np.maximum(t_data.arrived_Z, tail_RR[data.src_Z, data.dst_Z])
    elif sync == "sp":  # the sentinel is armed before any data may land
        armed_R = np.full(R, float(copy_us(topo, capacity_rows * SENTINEL_BYTES)))
        wire = replace(wire, ready_Z=np.maximum(wire.ready_Z, armed_R[data.dst_Z] - lat_Z))
        t_extra, t_data = _run([extra, wire], topo, params, workers)
        ready_Z = t_data.arrived_Z
    else:
        t_extra, t_data = _run([extra, wire], topo, params, workers)
        ready_Z = t_data.arrived_Z
    usable_RR = pair_max(data.src_Z, data.dst_Z, ready_Z + params.poll_us, R)
    return Delivery(usable_RR=usable_RR, extra=t_extra, data=t_data, reorder_factor=reorder_factor(sync))

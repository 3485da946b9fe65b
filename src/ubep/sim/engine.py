"""The fabric model: messages through a tandem of shared stages.

Each message passes, in order:
  worker      the sending worker (one per (rank, worker) pair), in the worker's
              own order; it costs o + b / worker_rate[c] (+ `hold_us`, time the
              worker stays blocked after the data, e.g. waiting for an ack)
  inject      the source device's port for the message's class
  uplinks     for every level whose uplink is capped and that the message leaves:
              the source domain's egress, then the destination domain's ingress
  latency     lat[c], added to head and tail
  eject       the destination device's port (incast queues here)

The worker stage is FIFO (a worker sends its messages one after another):
done_m = max(ready_m + s_m, done_{m-1} + s_m), Lindley's recurrence, solved per
queue with one cumulative sum and one running maximum (`fifo`).

Injection ports and uplinks are shared *fairly* (`fair_share`): every flow present at a
port gets an equal share of its bandwidth, except that no flow runs faster than
it arrives (its upstream rate, e.g. a worker's window-limited rate); what a slow
flow leaves unused goes to the others (max-min fair, by water-filling). Two
equal flows on one port each get half of it. A flow is present from its head's
arrival until its last byte has passed; a tail never leaves before its own
upstream tail (cut-through). The per-port event loop (`fairshare.py`) is compiled with
numba where it is installed (the `fast` extra), and runs as plain Python otherwise.
The ejection port is the same kind of server, work-conserving but FIFO in head
order (`fifo`, cut-through): a receiver needs all of its bytes, and the time of
its last byte does not depend on the order in which the port serves flows, while
fair sharing among the thousands of flows of an incast would cost seconds per run.

Times in us, sizes in bytes, rates in GB/s (1e3 B/us). Z messages (of a simulated plan; legend in layout.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ubep.costmodel import CostParams, port_gbps_C, worker_gbps_C
from ubep.topology import Topology


@dataclass(frozen=True, kw_only=True, slots=True)
class Messages:
    """What to send. Worker order is `seq` (ascending) within each (src, worker)."""

    src_Z: np.ndarray  # int64 sender rank
    dst_Z: np.ndarray  # int64 receiver rank
    worker_Z: np.ndarray  # int64 sending worker on the sender rank
    seq_Z: np.ndarray  # float or int: position in that worker's order
    bytes_Z: np.ndarray  # int64
    ready_Z: np.ndarray  # float: earliest start
    hold_us_Z: np.ndarray | None = None  # float: worker blocked after the data

    @property
    def size(self) -> int:
        return self.src_Z.size


def concat(parts: list[Messages]) -> Messages:
    """One message set from several (holds default to zero)."""
    fields = [f for f in Messages.__slots__ if f != "hold_us_Z"]
    merged = {f: np.concatenate([getattr(p, f) for p in parts]) for f in fields}
    holds = [p.hold_us_Z if p.hold_us_Z is not None else np.zeros(p.size) for p in parts]
    return Messages(**merged, hold_us_Z=np.concatenate(holds))


def pair_max(src: np.ndarray, dst: np.ndarray, t: np.ndarray, R: int, floor: float = 0.0) -> np.ndarray:
    """float [R, R]: the latest t for each (src, dst) pair (floor where there is none)."""
    out = np.full(R * R, floor)
    np.maximum.at(out, src * R + dst, t)
    return out.reshape(R, R)


@dataclass(frozen=True, kw_only=True, slots=True)
class Timing:
    """When each message's tail left its worker and its port, and reached the receiver."""

    cls_Z: np.ndarray  # int64 distance class
    issued_Z: np.ndarray  # worker done with it (including any hold)
    injected_Z: np.ndarray  # tail left the source port
    arrived_Z: np.ndarray  # tail landed at the receiver


def fifo(key: np.ndarray, order: np.ndarray, head: np.ndarray, tail: np.ndarray, svc: np.ndarray):
    """One stage of servers (one per `key`), taking work in `order`; returns (start, tail_out).

    The server's work is the messages' service times, available from their heads:
    done_m = max(head_m + svc_m, done_{m-1} + svc_m) (Lindley, FIFO), and a tail
    leaves at max(tail_m, done_m): the stage keeps its rate while one slow upstream
    flow trickles in (a port multiplexes flows), and never lets a tail overtake
    its own upstream. start_m = max(head_m, done_{m-1}).
    """
    idx = np.lexsort((order, key))
    k, s, h = key[idx], svc[idx], head[idx]
    new = np.r_[True, k[1:] != k[:-1]]
    seg = np.cumsum(new) - 1
    total = np.cumsum(s)
    s_local = total - (total - s)[new][seg]  # inclusive sum of svc within the queue
    y = h + s - s_local
    lift = (y.max() - y.min() + 1.0) * seg if y.size else y  # keeps the running max inside a queue
    done = s_local + np.maximum.accumulate(y + lift) - lift  # max(h_m + s_m, done_{m-1} + s_m)
    prev = np.r_[-np.inf, done[:-1]]
    prev[new] = -np.inf
    start, tail_out = np.empty_like(done), np.empty_like(done)
    start[idx], tail_out[idx] = np.maximum(h, prev), np.maximum(tail[idx], done)
    return start, tail_out


def fair_share(key: np.ndarray, head: np.ndarray, tail: np.ndarray, nbytes: np.ndarray, rate: np.ndarray):
    """One stage of fairly shared servers (one per `key`, `rate` bytes/us each); returns tail_out.

    Message m is present from head_m and arrives no faster than nbytes_m / (tail_m - head_m).
    """
    idx = np.lexsort((head, key))
    k = key[idx]
    starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1], True])
    h, b = head[idx].astype(float), nbytes[idx].astype(float)
    span = tail[idx] - h
    cap = np.where(span > 0, b / np.where(span > 0, span, 1.0), np.inf)
    done = np.empty_like(h)
    from ubep.sim.fairshare import fair_queues  # here, not at the top: numba loads only when a plan runs

    fair_queues(starts.astype(np.int64), h, b, cap, rate[idx].astype(float), done)
    out = np.empty_like(done)
    out[idx] = np.maximum(tail[idx], done)
    return out


def simulate(msgs: Messages, topo: Topology, params: CostParams, workers: int) -> Timing:
    """Run messages through worker, port, uplink, latency and ejection stages."""
    if msgs.size == 0:
        empty = np.zeros(0)
        return Timing(cls_Z=empty.astype(np.int64), issued_Z=empty, injected_Z=empty, arrived_Z=empty)
    cls = topo.distance_class(msgs.src_Z, msgs.dst_Z)
    b = msgs.bytes_Z.astype(float)
    hold = np.zeros_like(b) if msgs.hold_us_Z is None else msgs.hold_us_Z
    data_us = b / (worker_gbps_C(topo, params)[cls] * 1e3)
    start, issued = fifo(
        msgs.src_Z * workers + msgs.worker_Z,
        msgs.seq_Z,
        msgs.ready_Z,
        msgs.ready_Z,
        params.msg_overhead_us + data_us + hold,
    )
    head, tail = start + params.msg_overhead_us, issued - hold
    port_rate = port_gbps_C(topo, params)[cls] * 1e3  # bytes per us
    num_ports = len(topo.ports_gbps) + 1  # + the local copy path of class 0
    port = np.where(cls == 0, num_ports - 1, topo.port_of_class_C()[cls])
    src_dev, dst_dev = topo.device_of(msgs.src_Z), topo.device_of(msgs.dst_Z)
    injected = fair_share(src_dev * num_ports + port, head, tail, b, port_rate)
    tail = injected.copy()
    for lv, level in enumerate(topo.levels[1:], start=1):
        out = np.flatnonzero(cls > lv)  # messages that leave their level-lv domain
        if level.uplink_gbps is None or out.size == 0:
            continue
        up_rate = np.full(out.size, params.link_efficiency * level.uplink_gbps * 1e3)
        for dev in (src_dev[out], dst_dev[out]):  # egress of the source domain, ingress of the other
            tail[out] = fair_share(dev // level.span, head[out], tail[out], b[out], up_rate)
    lat = topo.latency_C()[cls]
    _, arrived = fifo(dst_dev * num_ports + port, head + lat, head + lat, tail + lat, b / port_rate)
    return Timing(cls_Z=cls, issued_Z=issued, injected_Z=injected, arrived_Z=arrived)

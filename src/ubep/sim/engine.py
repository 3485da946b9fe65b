"""The fabric model: messages through a tandem of shared FIFO stages, vectorised.

Each message passes, in order:
  worker      the sending worker (one per (rank, worker) pair), in the worker's
              own order; it costs o + b / worker_rate[c] (+ `hold_us`, time the
              worker stays blocked after the data, e.g. waiting for an ack)
  inject      the source device's port for the message's class
  uplinks     for every level whose uplink is capped and that the message leaves:
              the source domain's egress, then the destination domain's ingress
  latency     lat[c], added to head and tail
  eject       the destination device's port (incast queues here)

Each stage is a server in cut-through mode: it works through the messages'
bytes in FIFO order as their heads arrive (done_m = max(head_m + s_m,
done_{m-1} + s_m), Lindley's recurrence, solved per queue with one cumulative
sum and one running maximum: no Python loop over messages), and a tail leaves
at max(its upstream tail, done_m). So a port shared by many slow worker flows
still moves bytes at its full rate, and no message beats its own upstream.

Times in us, sizes in bytes, rates in GB/s (1e3 B/us). M messages.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ubep.costmodel import CostParams, port_gbps_C, worker_gbps_C
from ubep.topology import Topology


@dataclass(frozen=True, kw_only=True, slots=True)
class Messages:
    """What to send. Worker order is `seq` (ascending) within each (src, worker)."""

    src_M: np.ndarray  # int64 sender rank
    dst_M: np.ndarray  # int64 receiver rank
    worker_M: np.ndarray  # int64 sending worker on the sender rank
    seq_M: np.ndarray  # float or int: position in that worker's order
    bytes_M: np.ndarray  # int64
    ready_M: np.ndarray  # float: earliest start
    hold_us_M: np.ndarray | None = None  # float: worker blocked after the data

    @property
    def size(self) -> int:
        return self.src_M.size


@dataclass(frozen=True, kw_only=True, slots=True)
class Timing:
    """When each message's tail left its worker and its port, and reached the receiver."""

    cls_M: np.ndarray  # int64 distance class
    issued_M: np.ndarray  # worker done with it (including any hold)
    injected_M: np.ndarray  # tail left the source port
    arrived_M: np.ndarray  # tail landed at the receiver


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


def simulate(msgs: Messages, topo: Topology, params: CostParams, workers: int) -> Timing:
    """Run messages through worker, port, uplink, latency and ejection stages."""
    if msgs.size == 0:
        empty = np.zeros(0)
        return Timing(cls_M=empty.astype(np.int64), issued_M=empty, injected_M=empty, arrived_M=empty)
    cls = topo.distance_class(msgs.src_M, msgs.dst_M)
    b = msgs.bytes_M.astype(float)
    hold = np.zeros_like(b) if msgs.hold_us_M is None else msgs.hold_us_M
    data_us = b / (worker_gbps_C(topo, params)[cls] * 1e3)
    start, issued = fifo(
        msgs.src_M * workers + msgs.worker_M,
        msgs.seq_M,
        msgs.ready_M,
        msgs.ready_M,
        params.msg_overhead_us + data_us + hold,
    )
    head, tail = start + params.msg_overhead_us, issued - hold
    port_us = b / (port_gbps_C(topo, params)[cls] * 1e3)
    num_ports = len(topo.ports_gbps) + 1  # + the local copy path of class 0
    port = np.where(cls == 0, num_ports - 1, topo.port_of_class_C()[cls])
    src_dev, dst_dev = topo.device_of(msgs.src_M), topo.device_of(msgs.dst_M)
    head, injected = fifo(src_dev * num_ports + port, head, head, tail, port_us)
    tail = injected
    for lv, level in enumerate(topo.levels[1:], start=1):
        out = np.flatnonzero(cls > lv)  # messages that leave their level-lv domain
        if level.uplink_gbps is None or out.size == 0:
            continue
        up_us = b[out] / (params.link_efficiency * level.uplink_gbps * 1e3)
        for dev in (src_dev[out], dst_dev[out]):  # egress of the source domain, ingress of the other
            head[out], tail[out] = fifo(dev // level.span, head[out], head[out], tail[out], up_us)
    lat = topo.latency_C()[cls]
    _, arrived = fifo(dst_dev * num_ports + port, head + lat, head + lat, tail + lat, port_us)
    return Timing(cls_M=cls, issued_M=issued, injected_M=injected, arrived_M=arrived)

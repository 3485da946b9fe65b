"""The one cost model that the scheduler and the simulator share.

A message of `b` bytes at distance class c, sent by one worker on an idle fabric, costs

    message_us = o + lat[c] + b / worker_rate[c]
    worker_rate[c] = min(eta * port_gbps[c], window / lat[c])          (GB/s = 1e3 B/us)

o: per-message issue overhead on the worker; lat: one-way latency of class c;
eta: achievable fraction of a port's nominal bandwidth; window[c]: bytes one worker
keeps in flight to class c (outstanding requests x request size), so by Little's
law it cannot stream faster than window / lat.
The window term is why distance matters even on a fabric with uniform bandwidth:
a worker whose messages all go two hops away streams at a third of the rate of a
worker sending one hop away. On a loaded fabric the simulator adds queueing at
each shared port and uplink; the scheduler only needs the idle-fabric cost, to
order each worker's transfers slowest first.

Fitted values come from `ubep.sim.calibrate` (see docs/simulation.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ubep.topology import Topology

# eta and call fitted on DeepEP's low-latency EP8/EP64 numbers (docs/paper_figures.md); o, which those
# barely see, chosen with them and the CloudMatrix384 points below. See ubep.sim.calibrate.
FIT_MSG_OVERHEAD_US = 0.2
FIT_LINK_EFFICIENCY = 1.0  # DeepEP counts bytes such that RDMA reaches its nominal 50 GB/s
FIT_CALL_US = 34.05  # fixed cost of one dispatch or combine call (kernel start, setup)
# Fitted on UBEP's EP64 reductions (batch 8, 128) and the scheduling ablation's first step, on
# CloudMatrix384 (docs/paper_figures.md), see ubep.sim.calibrate: outstanding write requests per worker.
REQUEST_BYTES = 512  # one write request on the fabric (the UB's 512 B write, the paper's TFF unit)
FIT_OUTSTANDING_REQUESTS = 64
WINDOW_BYTES = FIT_OUTSTANDING_REQUESTS * REQUEST_BYTES  # one worker's bytes in flight, every class
# Assumed (no published figure to fit against).
POLL_US = 0.05  # checking one flag word in local memory
PREFIX_US = 1.0  # the per-expert prefix-sum kernel
FLAG_BYTES = 64  # a flag or count write, rounded up to one cache line
TFF_WRITE_BYTES, TFF_FLAG_BYTES = 512, 32  # Data-as-Flag TFF: 32 B flag + 480 B payload a write (UBEP)
SENTINEL_BYTES = 64  # Data-as-Flag SP: the sentinel line the receiver arms in each receive slot: assumed


@dataclass(frozen=True, kw_only=True, slots=True)
class CostParams:
    """The free and assumed constants of the model (defaults: the fitted/assumed values above)."""

    msg_overhead_us: float = FIT_MSG_OVERHEAD_US
    link_efficiency: float = FIT_LINK_EFFICIENCY
    call_us: float = FIT_CALL_US
    window_bytes: float | tuple[float, ...] = WINDOW_BYTES  # one value, or one per distance class
    poll_us: float = POLL_US
    prefix_us: float = PREFIX_US
    flag_bytes: int = FLAG_BYTES


def port_gbps_C(topo: Topology, params: CostParams) -> np.ndarray:
    """float [C]: achievable bandwidth of the port each distance class uses.

    Class 0 (a rank writing into its own device) is a local copy, not a fabric transfer.
    """
    gbps_C = params.link_efficiency * topo.port_gbps_C()
    gbps_C[0] = topo.local_copy_gbps
    return gbps_C


def window_C(topo: Topology, params: CostParams) -> np.ndarray:
    """float [C]: bytes one worker may have in flight per distance class.

    `window_bytes` is one value for every class, or a tuple indexed by class whose
    last entry also covers any farther class (a per-class outstanding-request limit).
    """
    w = np.atleast_1d(np.asarray(params.window_bytes, dtype=float))
    return w[np.minimum(np.arange(topo.num_classes), w.size - 1)]


def worker_gbps_C(topo: Topology, params: CostParams) -> np.ndarray:
    """float [C]: the most one worker can stream to a destination of each class."""
    return np.minimum(port_gbps_C(topo, params), window_C(topo, params) / 1e3 / topo.latency_C())


def message_us(topo: Topology, params: CostParams, cls: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Idle-fabric time of messages (broadcast over class and byte arrays), in us."""
    cls = np.asarray(cls)
    rate = worker_gbps_C(topo, params)[cls] * 1e3  # bytes per us
    return params.msg_overhead_us + topo.latency_C()[cls] + np.asarray(nbytes) / rate


def copy_us(topo: Topology, nbytes: np.ndarray | float) -> np.ndarray:
    """Device-local copy (reorder, reduce) of `nbytes`, in us."""
    return np.asarray(nbytes, dtype=float) / (topo.local_copy_gbps * 1e3)

"""Experts placed by load and by distance: redundant copies of hot experts, each token sent to
its nearest copy.

    loads (per source rank and expert) --balance / eplb--> Placement (physical slot -> logical expert)
    Placement + this rank's distances  --CopyMap-->        logical top-k -> physical top-k

`balance` is ubep's placement (load first, then traffic across nodes for the observed sources);
`eplb` is the load-only baseline (DeepSeek's hierarchical balancer, written anew). A
`Placement` lays out U = R * L physical experts, L per rank, contiguously (physical expert u
lives on rank u // L, as vLLM numbers them); `CopyMap` turns a rank's logical routing into
physical ids before dispatch, so a Buffer built with U experts, or any DeepEP-style caller that
passes physical ids, carries it unchanged.

Legend: see `ubep.layout`; here also U physical experts (slots, R * L) and J copies of one expert.
"""

from ubep.placement.balance import balance
from ubep.placement.baseline import eplb
from ubep.placement.copymap import CopyMap
from ubep.placement.distances import Distances
from ubep.placement.measure import PlacementStats, measure
from ubep.placement.table import Placement

__all__ = ["CopyMap", "Distances", "Placement", "PlacementStats", "balance", "eplb", "measure"]

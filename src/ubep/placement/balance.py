"""ubep's placement: the maximum rank load first, then the traffic of the observed sources.

The load is counted in (token, expert) pairs per source rank and expert, and the rank load is
what `CopyMap.nearest` sends to each rank: a source's pairs for an expert go to its nearest
copies, shared evenly among equally near ones. Under the load bound
`cap = (1 + slack) x mean rank load`:

  1. one copy per expert, heaviest first: onto the rank with a free slot where the expert's
     traffic (its sources' pairs, by distance class, `Distances.cost_RR`) is least, among ranks
     it fits under the bound; where it fits nowhere, onto the least loaded rank with room;
  2. each redundant slot, one at a time, to the (expert, rank) that lowers max(max rank load,
     cap) most, and among equals the traffic most; the rank loads of every candidate are exact
     under the map's rule (a new copy takes over the sources it is now nearest to).

Where every source has the same mix (one popularity for all), step 2 spreads hot experts over
nodes, so each node serves its own pairs; where sources differ, step 1 already puts each expert
beside the sources that use it most.
"""

from __future__ import annotations

import numpy as np
import torch

from ubep.placement.distances import Distances
from ubep.placement.table import Placement

LOAD_SLACK = 0.05  # the load bound: 5 % above the mean rank load (the target is 15 %)


def by_source(load, num_ranks: int) -> np.ndarray:
    """float64 [R, E]: pairs per source rank and expert; a load per expert ([E]) is spread evenly."""
    load_XE = np.asarray(load, dtype=np.float64)
    if load_XE.ndim == 1:
        return np.repeat(load_XE[None, :] / num_ranks, num_ranks, axis=0)
    if load_XE.ndim != 2 or load_XE.shape[0] != num_ranks:
        raise ValueError(f"load must be [E] or [R={num_ranks}, E] (pairs per source and expert)")
    return load_XE


def served(demand_R: np.ndarray, ranks_J: np.ndarray, distances: Distances) -> tuple[np.ndarray, float]:
    """(pairs each copy serves [J], their traffic cost): each source to its nearest copies, evenly."""
    class_RJ = distances.class_RR[:, ranks_J]
    near_RJ = class_RJ == class_RJ.min(axis=1, keepdims=True)
    share_RJ = demand_R[:, None] * near_RJ / near_RJ.sum(axis=1, keepdims=True)
    return share_RJ.sum(axis=0), float((share_RJ * distances.cost_C()[class_RJ]).sum())


def _with_each_rank(demand_R: np.ndarray, ranks_J: np.ndarray, distances: Distances):
    """For a new copy on each rank c: (rank loads of the expert [C, R], traffic cost [C])."""
    R = demand_R.size
    class_CRJ = np.concatenate(
        [
            np.broadcast_to(distances.class_RR[:, ranks_J], (R, R, ranks_J.size)),
            distances.class_RR.T[:, :, None],
        ],
        axis=2,
    )  # candidate c, source s, copy (the last is the new one on c)
    near_CRJ = class_CRJ == class_CRJ.min(axis=2, keepdims=True)
    share_CRJ = demand_R[None, :, None] * near_CRJ / near_CRJ.sum(axis=2, keepdims=True)
    per_copy_CJ = share_CRJ.sum(axis=1)
    loads_CR = np.zeros((R, R))
    np.add.at(loads_CR, (slice(None), ranks_J), per_copy_CJ[:, :-1])
    loads_CR[np.arange(R), np.arange(R)] += per_copy_CJ[:, -1]
    return loads_CR, (share_CRJ * distances.cost_C()[class_CRJ]).sum(axis=(1, 2))


def balance(load, distances: Distances, slots_per_rank: int, slack: float = LOAD_SLACK) -> Placement:
    """A placement of E experts on R * slots_per_rank slots from the pairs per (source rank, expert).

    `load` is [R, E] (or [E]: sources unknown, taken as even); `distances` gives the classes
    between ranks (`Distances.from_nodes`, or `.from_topology`).
    """
    R, L = distances.num_ranks, slots_per_rank
    demand_RE = by_source(load, R)
    E = demand_RE.shape[1]
    if R * L < E:
        raise ValueError(f"balance: {R} ranks x {L} slots hold fewer than the {E} experts")
    total_E = demand_RE.sum(axis=0)
    cap = (1 + slack) * total_E.sum() / R
    ranks_of = _single_copies(demand_RE, total_E, distances, L - (R * L - E) // R, cap)
    _redundant_copies(demand_RE, ranks_of, distances, L, cap)
    logical_of_physical = np.concatenate(
        [sorted(e for e in range(E) if r in ranks_of[e]) for r in range(R)]
    ).astype(np.int64)
    return Placement(R, E, torch.from_numpy(logical_of_physical))


def _single_copies(
    demand_RE: np.ndarray, total_E: np.ndarray, distances: Distances, limit: int, cap: float
) -> list[list[int]]:
    """Step 1: each expert's first copy (at most `limit` per rank, leaving the redundant slots)."""
    R = distances.num_ranks
    cost_ER = demand_RE.T @ distances.cost_RR()  # traffic if the expert's only copy sat on rank r
    load_R, used_R = np.zeros(R), np.zeros(R, dtype=np.int64)
    ranks_of: list[list[int]] = [[] for _ in range(total_E.size)]
    for e in np.argsort(-total_E, kind="stable"):
        free_R = used_R < limit
        fits_R = free_R & (load_R + total_E[e] <= cap)
        if fits_R.any():
            r = min(np.flatnonzero(fits_R), key=lambda c: (cost_ER[e, c], load_R[c], c))
        else:
            r = min(np.flatnonzero(free_R), key=lambda c: (load_R[c], c))
        ranks_of[e].append(int(r))
        load_R[r] += total_E[e]
        used_R[r] += 1
    return ranks_of


def _redundant_copies(
    demand_RE: np.ndarray, ranks_of: list[list[int]], distances: Distances, L: int, cap: float
) -> None:
    """Step 2: fill every remaining slot with the copy that helps most (exact loads, see the module)."""
    R, E = demand_RE.shape
    contrib_ER, cost_E = np.zeros((E, R)), np.zeros(E)
    for e in range(E):
        ranks = np.asarray(ranks_of[e])
        per_copy, cost_E[e] = served(demand_RE[:, e], ranks, distances)
        contrib_ER[e, ranks] = per_copy
    used_R = np.bincount([r for ranks in ranks_of for r in ranks], minlength=R)
    scale = max(cap, 1e-12)
    for _ in range(R * L - used_R.sum()):
        load_R, traffic = contrib_ER.sum(axis=0), cost_E.sum()
        best, choice = None, None
        for e in range(E):
            if len(ranks_of[e]) >= R or demand_RE[:, e].sum() == 0:
                continue
            loads_CR, cost_C = _with_each_rank(demand_RE[:, e], np.asarray(ranks_of[e]), distances)
            allowed_C = used_R < L
            allowed_C[ranks_of[e]] = False
            if not allowed_C.any():
                continue
            peak_C = np.maximum((load_R - contrib_ER[e] + loads_CR).max(axis=1), cap) / scale
            peak_C = np.where(allowed_C, np.round(peak_C, 9), np.inf)  # rounded: equal peaks tie
            traffic_C = np.where(peak_C == peak_C.min(), traffic - cost_E[e] + cost_C, np.inf)
            c = int(np.argmin(traffic_C))
            key = (peak_C[c], traffic_C[c])  # the load bound first, then the traffic
            if best is None or key < best:
                best, choice = key, (e, c, loads_CR[c], cost_C[c])
        if choice is None:  # only idle experts left: any expert, any free slot
            e = next(e for e in range(E) if len(ranks_of[e]) < R)
            c = int(next(r for r in range(R) if used_R[r] < L and r not in ranks_of[e]))
            choice = (e, c, contrib_ER[e], cost_E[e])
        e, c, contrib_ER[e], cost_E[e] = choice
        ranks_of[e].append(c)
        used_R[c] += 1

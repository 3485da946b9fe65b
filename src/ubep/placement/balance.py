"""ubep's placement: the maximum rank load first, then the traffic of the observed sources.

The load is counted in (token, expert) pairs per source rank and expert, and the rank load is
what `CopyMap.nearest` sends to each rank: a source's pairs for an expert go to its nearest
copies, shared evenly among equally near ones. Under the load bound
`cap = (1 + slack) x mean rank load`:

  1. one copy per expert, heaviest first: onto the rank with a free slot where the expert's
     traffic (its sources' pairs, by distance class, `Distances.cost_RR`) is least, among ranks
     it fits under the bound; where it fits nowhere, onto the least loaded rank with room;
  2. each redundant slot, one at a time, to the (expert, rank) that lowers max(max rank load,
     cap) most, among equals the load above the bound summed over ranks, then the traffic; the
     rank loads of every candidate are exact under the map's rule (a new copy takes over the
     sources it is now nearest to);

  3. while the busiest rank is above the bound: the one change that lowers (max rank load, load
     above the bound) most: swap one of its experts with one of another rank's, or turn a
     redundant copy elsewhere into a copy of one of its experts; stop when none helps.

Where every source has the same mix (one popularity for all), step 2 spreads hot experts over
nodes, so each node serves its own pairs; where sources differ, step 1 already puts each expert
beside the sources that use it most.
"""

from __future__ import annotations

import numpy as np
import torch

from ubep.placement.distances import Distances
from ubep.placement.table import Placement

LOAD_SLACK = 0.02  # the load bound: 2 % above the mean rank load (tighter bounds found less traffic too)


def by_source(load, num_ranks: int) -> np.ndarray:
    """float64 [R, E]: pairs per source rank and expert; a load per expert ([E]) is spread evenly."""
    load_XE = np.asarray(load, dtype=np.float64)
    if load_XE.ndim == 1:
        return np.repeat(load_XE[None, :] / num_ranks, num_ranks, axis=0)
    if load_XE.ndim != 2 or load_XE.shape[0] != num_ranks:
        raise ValueError(f"load must be [E] or [R={num_ranks}, E] (pairs per source and expert)")
    return load_XE


def served(
    demand_R: np.ndarray, ranks_J: np.ndarray, distances: Distances, cost_RR: np.ndarray
) -> tuple[np.ndarray, float]:
    """(pairs each copy serves [J], their traffic cost): each source to its nearest copies, evenly."""
    class_RJ = distances.class_RR[:, ranks_J]
    near_RJ = class_RJ == class_RJ.min(axis=1, keepdims=True)
    share_RJ = demand_R[:, None] * near_RJ / near_RJ.sum(axis=1, keepdims=True)
    return share_RJ.sum(axis=0), float((share_RJ * cost_RR[:, ranks_J]).sum())


def _with_each_rank(demand_R: np.ndarray, ranks_J: np.ndarray, distances: Distances, cost_RR: np.ndarray):
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
    cost_CRJ = np.concatenate(
        [np.broadcast_to(cost_RR[:, ranks_J], (R, R, ranks_J.size)), cost_RR.T[:, :, None]], axis=2
    )
    return loads_CR, (share_CRJ * cost_CRJ).sum(axis=(1, 2))


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
    cap = max((1 + slack) * total_E.sum() / R, 1e-9)  # no load at all: any placement will do
    ranks_of = _single_copies(demand_RE, total_E, distances, L - (R * L - E) // R, cap)
    _redundant_copies(demand_RE, ranks_of, distances, L, cap)
    _relieve_peak(demand_RE, ranks_of, distances, cap)
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
    cost_RR = distances.cost_RR()
    contrib_ER, cost_E = np.zeros((E, R)), np.zeros(E)
    for e in range(E):
        ranks = np.asarray(ranks_of[e])
        per_copy, cost_E[e] = served(demand_RE[:, e], ranks, distances, cost_RR)
        contrib_ER[e, ranks] = per_copy
    used_R = np.bincount([r for ranks in ranks_of for r in ranks], minlength=R)
    for _ in range(R * L - used_R.sum()):
        load_R, traffic = contrib_ER.sum(axis=0), cost_E.sum()
        now = _key(load_R, cap, traffic)
        on_busy_E = contrib_ER[:, load_R > cap].sum(axis=1) > 0  # only these can lower the load terms
        best, choice = None, None
        for e in np.argsort(-cost_E, kind="stable"):  # most traffic first: the rest is pruned below
            if len(ranks_of[e]) >= R or demand_RE[:, e].sum() == 0:
                continue
            if (
                not on_busy_E[e]
                and best is not None
                and (now[:2], traffic - cost_E[e]) >= (best[:2], best[2])
            ):
                continue  # cannot lower the load terms, nor the traffic below the best found
            loads_CR, cost_C = _with_each_rank(demand_RE[:, e], np.asarray(ranks_of[e]), distances, cost_RR)
            allowed_C = used_R < L
            allowed_C[ranks_of[e]] = False
            if not allowed_C.any():
                continue
            rank_loads_CR = load_R - contrib_ER[e] + loads_CR
            peak_C = np.where(
                allowed_C, np.round(np.maximum(rank_loads_CR.max(axis=1), cap) / cap, 9), np.inf
            )
            excess_C = np.round(np.maximum(rank_loads_CR - cap, 0).sum(axis=1) / cap, 9)
            key_C = np.lexsort((traffic - cost_E[e] + cost_C, excess_C, peak_C))
            c = int(key_C[0])
            key = (peak_C[c], excess_C[c], traffic - cost_E[e] + cost_C[c])  # load bound, excess, traffic
            if best is None or key < best:
                best, choice = key, (e, c, loads_CR[c], cost_C[c])
        if choice is None:  # only idle experts left: any expert, any free slot
            e = next(e for e in range(E) if len(ranks_of[e]) < R)
            c = int(next(r for r in range(R) if used_R[r] < L and r not in ranks_of[e]))
            choice = (e, c, contrib_ER[e], cost_E[e])
        e, c, contrib_ER[e], cost_E[e] = choice
        ranks_of[e].append(c)
        used_R[c] += 1


def _key(load_R: np.ndarray, cap: float, traffic: float) -> tuple[float, float, float]:
    """What the placement minimizes, in order: max(peak, cap), the load above cap, the traffic
    (loads in units of cap, rounded so that equal loads tie)."""
    peak = round(max(load_R.max(), cap) / cap, 9)
    return peak, round(float(np.maximum(load_R - cap, 0).sum()) / cap, 9), traffic


class _Loads:
    """Each expert's exact rank loads and traffic cost under its copies, and their totals."""

    def __init__(self, demand_RE: np.ndarray, ranks_of: list[list[int]], distances: Distances, cap: float):
        self.demand_RE, self.ranks_of, self.distances, self.cap = demand_RE, ranks_of, distances, cap
        self.cost_RR = distances.cost_RR()
        R, E = demand_RE.shape
        self.contrib_ER, self.cost_E = np.zeros((E, R)), np.zeros(E)
        for e in range(E):
            self.contrib_ER[e], self.cost_E[e] = self.of(e, ranks_of[e])

    def of(self, e: int, ranks: list[int]) -> tuple[np.ndarray, float]:
        """(rank loads [R], traffic cost) of expert e with copies on `ranks`."""
        per_copy, cost = served(self.demand_RE[:, e], np.asarray(ranks), self.distances, self.cost_RR)
        loads_R = np.zeros(self.demand_RE.shape[0])
        loads_R[ranks] = per_copy
        return loads_R, cost

    def key(self, load_R: np.ndarray, traffic: float) -> tuple[float, float, float]:
        return _key(load_R, self.cap, traffic)

    def try_change(
        self, changes: dict[int, list[int]], load_R: np.ndarray, traffic: float
    ) -> tuple[tuple, dict]:
        """The key after giving each expert in `changes` its new copies (from these totals), and
        their new loads."""
        new = {}
        for e, ranks in changes.items():
            new[e] = self.of(e, ranks)
            load_R = load_R - self.contrib_ER[e] + new[e][0]
            traffic += new[e][1] - self.cost_E[e]
        return self.key(load_R, traffic), new


def _relieve_peak(demand_RE: np.ndarray, ranks_of: list[list[int]], distances: Distances, cap: float) -> None:
    """Step 3 (see the module): local changes around the busiest rank while it is above the bound."""
    R, E = demand_RE.shape
    state = _Loads(demand_RE, ranks_of, distances, cap)
    for _ in range(4 * R):
        load_R = state.contrib_ER.sum(axis=0)
        h = int(np.argmax(load_R))
        if load_R[h] <= cap:
            return
        traffic = state.cost_E.sum()
        best, best_change = state.key(load_R, traffic), None
        for change in _changes_around(h, ranks_of, load_R):
            key, new = state.try_change(change, load_R, traffic)
            if key < best:
                best, best_change = key, (change, new)
        if best_change is None:
            return
        for e, ranks in best_change[0].items():
            ranks_of[e][:] = ranks
            state.contrib_ER[e], state.cost_E[e] = best_change[1][e]


def _changes_around(h: int, ranks_of: list[list[int]], load_R: np.ndarray):
    """Candidate changes for the busiest rank h, as {expert: its new copy ranks}."""
    on_h = [e for e, ranks in enumerate(ranks_of) if h in ranks]
    lighter = [r for r in np.argsort(load_R, kind="stable") if load_R[r] < load_R[h]]
    for r in lighter:
        on_r = [e for e, ranks in enumerate(ranks_of) if r in ranks]
        for a in on_h:
            if r in ranks_of[a]:
                continue
            for b in on_r:  # swap a (on h) and b (on r)
                if h not in ranks_of[b]:
                    yield {
                        a: [r if x == h else x for x in ranks_of[a]],
                        b: [h if x == r else x for x in ranks_of[b]],
                    }
            for b in on_r:  # b's copy on r becomes a copy of a
                if len(ranks_of[b]) > 1:
                    yield {a: [*ranks_of[a], int(r)], b: [x for x in ranks_of[b] if x != r]}

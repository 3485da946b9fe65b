"""UBEP's hierarchical token scheduler: which worker sends which tokens where, in what order.

A rank's *send list* holds each of its tokens once per destination rank (the
per-rank dedup of DeepEP's normal mode), grouped by destination; destination d's
group is d's ascending token list (`layout.tokens_for_rank`). A *piece* is a
contiguous slice [begin, end) of one destination's group, sent by one worker.

Policies (the scheduling ablation of the UBEP paper):
  "distance"  (a) the send list sorted near to far (by distance class), viewed as a
              class x worker matrix of slices and read column-major: each class's
              tokens are cut into W equal slices and worker w takes the w-th slice
              of every class; (b) the slice boundaries come from a prefix-sum search,
              remainders rotate across classes so loads differ by at most one token;
              (c) each worker's pieces ordered slowest first by the shared cost model.
              Every worker's share of every class is within one token of even, under
              any skew (see "distance-paper" for why we transpose tokens, not destinations).
  "distance-paper" the paper's literal remap: destinations near to far, written row-major
              into a [ceil(D / W), W] matrix and read column-major, then the send list
              cut into W equal slices, then (c). With skew, one hot destination can fill
              a whole slice, and that worker gets no share of the far classes.
  "balanced"  (b) only: destinations in ascending rank order, pieces in list order.
  "bsp"       whole destinations dealt round-robin to workers in the baseline's
              rotation order (me+1, me+2, ...), as barrier-phased libraries do.

"ubep" and "ubep-paper" are the older names of "distance" and "distance-paper" (from when the
policy shared the protocol's name): still accepted, they mean the same (`OLDER_NAMES`, mapped
once, by `policy_name`).

Worked example (docs/topology.md has it step by step): rank 0 of 4 ranks, 2
workers, counts [3, 1, 2, 2] to ranks 0..3 at classes [0, 1, 2, 2]. Class token
totals 3, 1, 4. Slices: class 0 -> 2, 1; class 1 -> 0, 1 (the extra rotates to
worker 1); class 2 -> 2, 2. Worker 0: rank 0 [0:2], rank 2 [0:2] (4 tokens);
worker 1: rank 0 [2:3], rank 1 [0:1], rank 3 [0:2] (4 tokens); far pieces first.

Legend: see `ubep.layout` (R ranks, D destinations with tokens, W workers, I pieces, C distance classes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ubep.costmodel import CostParams, message_us
from ubep.layout import ExpertPlacement, token_in_rank
from ubep.registry import BSP
from ubep.topology import Topology

DISTANCE, DISTANCE_PAPER, BALANCED = "distance", "distance-paper", "balanced"
BASELINE = BSP.name  # the bsp protocol's own order, as a policy
NAMES = (DISTANCE, DISTANCE_PAPER, BALANCED, BASELINE)  # each policy, by its name
OLDER_NAMES = {"ubep": DISTANCE, "ubep-paper": DISTANCE_PAPER}  # still accepted, meaning the same
POLICIES = NAMES + tuple(OLDER_NAMES)  # every name a caller may pass


def policy_name(policy: str) -> str:
    """The policy's name (`NAMES`) for any name a caller may pass (`POLICIES`); ValueError otherwise."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    return OLDER_NAMES.get(policy, policy)


@dataclass(frozen=True, kw_only=True, slots=True)
class RankPlan:
    """One rank's pieces, grouped by worker (ascending), each worker's in send order."""

    rank: int
    num_workers: int
    worker_I: np.ndarray  # int64 [P]
    dest_I: np.ndarray  # int64 [P]: destination rank
    begin_I: np.ndarray  # int64 [P]: slice of the destination's ascending token list
    end_I: np.ndarray  # int64 [P]
    bytes_I: np.ndarray  # int64 [P]

    def pieces(self, worker: int) -> list[tuple[int, slice, int]]:
        """Worker `worker`'s transfers in order, as (destination, token slice, bytes)."""
        idx = np.flatnonzero(self.worker_I == worker)
        return [
            (int(self.dest_I[i]), slice(int(self.begin_I[i]), int(self.end_I[i])), int(self.bytes_I[i]))
            for i in idx
        ]

    def worker_tokens_W(self) -> np.ndarray:
        """int64 [W]: tokens each worker sends."""
        return np.bincount(
            self.worker_I, weights=self.end_I - self.begin_I, minlength=self.num_workers
        ).astype(np.int64)


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """Every rank's plan for one exchange (dispatch, or combine with the counts transposed)."""

    policy: str
    num_workers: int
    row_bytes: int
    ranks: tuple[RankPlan, ...]


def send_counts(topk_idx: Sequence[torch.Tensor], placement: ExpertPlacement) -> np.ndarray:
    """int64 [R, R]: tokens rank s sends to rank d (each token once per destination rank)."""
    per_source = [token_in_rank(idx_NK, placement).sum(dim=0) for idx_NK in topk_idx]
    return torch.stack(per_source).numpy().astype(np.int64)


def transpose_order(
    dests_D: np.ndarray, cls_D: np.ndarray, rank: int, num_ranks: int, workers: int
) -> np.ndarray:
    """The paper's remap: destinations near to far, read column-major from a [ceil(D/W), W] matrix.

    Example (W=2, sorted 0,1,2,3): matrix rows (0,1),(2,3) -> 0,2,1,3.
    """
    near_first_D = near_to_far(dests_D, cls_D, rank, num_ranks)
    cols = -(-near_first_D.size // workers)
    padded = np.full(cols * workers, -1, dtype=np.int64)
    padded[: near_first_D.size] = near_first_D
    read = padded.reshape(cols, workers).T.reshape(-1)  # column-major read of the row-major fill
    return read[read >= 0]


def near_to_far(dests_D: np.ndarray, cls_D: np.ndarray, rank: int, num_ranks: int) -> np.ndarray:
    """Destinations by distance class, then in rotation order from `rank` (spreads incast)."""
    return dests_D[np.lexsort(((dests_D - rank) % num_ranks, cls_D))]


def equal_bounds(total: int, workers: int) -> np.ndarray:
    """int64 [W + 1]: cut `total` tokens into W slices whose sizes differ by at most one."""
    return np.arange(workers + 1) * total // workers


def class_bounds(class_tokens_C: np.ndarray, workers: int) -> np.ndarray:
    """int64 [C * W + 1]: each class's tokens cut into W slices, slot c * W + w for worker w.

    Worker w's share of class c is T_c // W, plus one for T_c % W workers chosen by
    rotating where the extras start, so every worker's total differs by <= 1 too.
    Example (W=2, classes of 3 and 1 tokens): class 0 -> 2, 1; class 1 -> 0, 1.
    """
    base_C, extra_C = np.divmod(class_tokens_C, workers)
    start_C = np.concatenate(([0], np.cumsum(extra_C)[:-1])) % workers
    w_W = np.arange(workers)
    gets_extra_CW = (w_W[None, :] - start_C[:, None]) % workers < extra_C[:, None]
    shares = (base_C[:, None] + gets_extra_CW).reshape(-1)
    return np.concatenate(([0], np.cumsum(shares)))


def partition(counts_D: np.ndarray, bounds: np.ndarray) -> tuple[np.ndarray, ...]:
    """Cut the send list at `bounds` (slot boundaries) and at destination boundaries.

    Returns (slot_I, dpos_I, begin_I, end_I): piece p is positions [begin, end) of the
    group of destination dpos and belongs to slot `slot`. Each piece is located by a
    prefix-sum search (searchsorted), with no loop over tokens or destinations.
    """
    dest_off = np.concatenate(([0], np.cumsum(counts_D)))  # [D + 1]
    cuts = np.unique(np.concatenate((bounds, dest_off)))
    start, stop = cuts[:-1], cuts[1:]
    slot_I = np.searchsorted(bounds, start, side="right") - 1
    dpos_I = np.searchsorted(dest_off, start, side="right") - 1
    return slot_I, dpos_I, start - dest_off[dpos_I], stop - dest_off[dpos_I]


def _token_pieces(counts_R: np.ndarray, rank: int, topo: Topology, workers: int, policy: str) -> tuple:
    """(worker_I, dest_I, begin_I, end_I) for the token-partitioning policies."""
    R = counts_R.size
    dests = np.flatnonzero(counts_R)
    cls = topo.distance_class(rank, dests)
    if policy == DISTANCE:
        dests = near_to_far(dests, cls, rank, R)
        class_tokens_C = np.bincount(topo.distance_class(rank, dests), counts_R[dests], topo.num_classes)
        bounds = class_bounds(class_tokens_C.astype(np.int64), workers)
    else:
        if policy == DISTANCE_PAPER:
            dests = transpose_order(dests, cls, rank, R, workers)
        bounds = equal_bounds(int(counts_R.sum()), workers)
    slot_I, dpos_I, begin_I, end_I = partition(counts_R[dests], bounds)
    return slot_I % workers, dests[dpos_I], begin_I, end_I


def _bsp_pieces(counts_R: np.ndarray, rank: int, workers: int) -> tuple[np.ndarray, ...]:
    """Whole destinations dealt round-robin in rotation order me+1, me+2, ..., me."""
    R = counts_R.size
    rot_R = (rank + 1 + np.arange(R)) % R
    dest_D = rot_R[counts_R[rot_R] > 0]
    worker_D = np.arange(dest_D.size) % workers
    order = np.lexsort((np.arange(dest_D.size), worker_D))
    zeros = np.zeros(dest_D.size, dtype=np.int64)
    return worker_D[order], dest_D[order], zeros, counts_R[dest_D[order]]


def plan_rank(
    counts_R: np.ndarray,
    rank: int,
    topo: Topology,
    *,
    workers: int,
    row_bytes: int,
    policy: str = DISTANCE,
    params: CostParams | None = None,
) -> RankPlan:
    """The pieces of one rank, given the tokens it sends to each rank (`counts_R`, int [R])."""
    policy = policy_name(policy)
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    counts_R = np.asarray(counts_R, dtype=np.int64)
    if policy == BASELINE:
        worker_I, dest_I, begin_I, end_I = _bsp_pieces(counts_R, rank, workers)
    else:
        worker_I, dest_I, begin_I, end_I = _token_pieces(counts_R, rank, topo, workers, policy)
    bytes_I = (end_I - begin_I) * row_bytes
    if policy in (DISTANCE, DISTANCE_PAPER):  # (c) slowest transfer first within each worker
        cost_I = message_us(topo, params or CostParams(), topo.distance_class(rank, dest_I), bytes_I)
        order = np.lexsort((-cost_I, worker_I))
        worker_I, dest_I, begin_I, end_I, bytes_I = (
            a[order] for a in (worker_I, dest_I, begin_I, end_I, bytes_I)
        )
    return RankPlan(
        rank=rank,
        num_workers=workers,
        worker_I=worker_I.astype(np.int64),
        dest_I=dest_I.astype(np.int64),
        begin_I=begin_I.astype(np.int64),
        end_I=end_I.astype(np.int64),
        bytes_I=bytes_I.astype(np.int64),
    )


def plan(
    counts_RR: np.ndarray,
    topo: Topology,
    *,
    workers: int,
    row_bytes: int,
    policy: str = DISTANCE,
    params: CostParams | None = None,
) -> Schedule:
    """Every rank's pieces from the send-count matrix (int [R, R], row = sender)."""
    ranks = tuple(
        plan_rank(row, s, topo, workers=workers, row_bytes=row_bytes, policy=policy, params=params)
        for s, row in enumerate(np.asarray(counts_RR))
    )
    return Schedule(policy=policy_name(policy), num_workers=workers, row_bytes=row_bytes, ranks=ranks)


def build(
    topk_idx: Sequence[torch.Tensor],
    placement: ExpertPlacement,
    topo: Topology,
    *,
    workers: int,
    row_bytes: int,
    policy: str = DISTANCE,
    params: CostParams | None = None,
) -> Schedule:
    """The dispatch schedule from every rank's routing (`topk_idx[s]` is rank s's [N, K])."""
    counts_RR = send_counts(topk_idx, placement)
    return plan(counts_RR, topo, workers=workers, row_bytes=row_bytes, policy=policy, params=params)

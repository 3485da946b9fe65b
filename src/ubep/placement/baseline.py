"""The load-only baseline: DeepSeek's expert-parallel load balancer (EPLB), hierarchical policy.

Written from the published description, not copied:
  1. pack expert groups onto nodes so that node loads are even (every node gets as many groups);
  2. inside each node, give extra copies, one at a time, to the expert whose load per copy is
     the largest, until the node's slots are used;
  3. pack the node's copies (each carrying its expert's load / copies) onto the node's ranks,
     L per rank, heaviest first onto the lightest rank with room.
Where the groups do not split over the nodes it runs the same steps with one node and one group
(EPLB's global policy). It sees only the load per expert, summed over sources: where a copy
lands says nothing about where its tokens come from.
"""

from __future__ import annotations

import numpy as np
import torch

from ubep.placement.table import Placement


def balanced_packing(weight_X: np.ndarray, num_packs: int) -> np.ndarray:
    """int64 [X]: the pack of each item; X / num_packs items per pack, heaviest first onto the
    lightest pack with room (ties: the lower pack).

    Example (weights [5, 1, 4, 2], 2 packs): 5 -> pack 0, 4 -> pack 1, 2 -> pack 1, 1 -> pack 0.
    """
    X = weight_X.size
    per_pack = X // num_packs
    load_G, count_G = np.zeros(num_packs), np.zeros(num_packs, dtype=np.int64)
    pack_X = np.empty(X, dtype=np.int64)
    for x in np.argsort(-weight_X, kind="stable"):
        room = np.flatnonzero(count_G < per_pack)
        g = room[np.argmin(load_G[room])]
        pack_X[x], load_G[g], count_G[g] = g, load_G[g] + weight_X[x], count_G[g] + 1
    return pack_X


def replicate(weight_E: np.ndarray, num_slots: int) -> np.ndarray:
    """int64 [num_slots]: the expert each slot holds; one slot per expert, then each extra slot to
    the expert with the largest weight per copy (ties: the lower id)."""
    copies_E = np.ones(weight_E.size, dtype=np.int64)
    extra = []
    for _ in range(num_slots - weight_E.size):
        e = int(np.argmax(weight_E / copies_E))
        copies_E[e] += 1
        extra.append(e)
    return np.concatenate([np.arange(weight_E.size), np.asarray(extra, dtype=np.int64)])


def eplb(
    load: torch.Tensor | np.ndarray,
    num_ranks: int,
    slots_per_rank: int,
    num_nodes: int = 1,
    num_groups: int | None = None,
) -> Placement:
    """A placement from the load per expert ([E], or [R, E] per source: summed), load only.

    Ranks r // (R / num_nodes) share a node; `num_groups` expert groups (default: one per node)
    are the unit of step 1.
    """
    load_E = np.asarray(load, dtype=np.float64)
    load_E = load_E.sum(axis=0) if load_E.ndim == 2 else load_E
    E, R, L = load_E.size, num_ranks, slots_per_rank
    U = R * L
    if U < E:
        raise ValueError(f"eplb: {R} ranks x {slots_per_rank} slots hold fewer than the {E} experts")
    G = num_groups or num_nodes
    if E % G or G % num_nodes or R % num_nodes or (U - E) % num_nodes:
        num_nodes, G = 1, 1  # the global policy
    node_of_group = balanced_packing(load_E.reshape(G, E // G).sum(axis=1), num_nodes)
    ranks_per_node, slots_per_node = R // num_nodes, U // num_nodes
    logical_of_physical = np.empty(U, dtype=np.int64)
    for node in range(num_nodes):
        experts = np.flatnonzero(np.repeat(node_of_group, E // G) == node)  # this node's logical experts
        slots = replicate(load_E[experts], slots_per_node)  # indices into `experts`
        copies = np.bincount(slots, minlength=experts.size)
        rank_of_slot = balanced_packing(load_E[experts][slots] / copies[slots], ranks_per_node)
        order = np.argsort(rank_of_slot, kind="stable")  # slot by slot, rank-major
        logical_of_physical[node * slots_per_node : (node + 1) * slots_per_node] = experts[slots[order]]
    return Placement(R, E, torch.from_numpy(logical_of_physical))

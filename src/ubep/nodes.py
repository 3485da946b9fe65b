"""Nodes of an EP group: which ranks share a host, and how ranks pair up across hosts.

A group of R ranks spans G nodes of P ranks each (R = G * P). Within a node,
ranks are ordered by global rank; a rank's *local index* is its position
there. The *rail* of local index l is the l-th rank of every node, ordered by
global rank (that is the rank order of a torch.distributed group made of
them). As in DeepEP, traffic between two nodes runs only between the two
ranks of one rail, so a token crosses to a node once and fans out there.

Legend: see `ubep.layout` (G nodes, which are rail slots; V ranks per node).
Example, node_of_rank = (0, 0, 1, 1): node 0 holds ranks 0, 1; rail 1 is
ranks (1, 3); rank 3 has local index 1 and sits in slot 1 of its rail.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class NodeMap:
    """Node membership of every rank (node ids numbered 0..G-1)."""

    node_of_rank: tuple[int, ...]

    @property
    def num_ranks(self) -> int:
        return len(self.node_of_rank)

    @property
    def num_nodes(self) -> int:
        return len(set(self.node_of_rank))

    @property
    def ranks_per_node(self) -> int:
        return self.num_ranks // self.num_nodes

    def uniform(self) -> tuple[bool, str]:
        """(ok, reason): rails need every node to hold the same number of ranks."""
        sizes = sorted(Counter(self.node_of_rank).values())
        if sizes[0] != sizes[-1]:
            return False, f"nodes hold different numbers of ranks {sizes}: ranks cannot pair into rails"
        return True, f"{self.num_nodes} node(s) of {sizes[0]} rank(s)"

    def node_ranks(self, node: int) -> tuple[int, ...]:
        """Global ranks on `node`, ascending (the rank order of its node group)."""
        return tuple(r for r, n in enumerate(self.node_of_rank) if n == node)

    def local_index(self, rank: int) -> int:
        return self.node_ranks(self.node_of_rank[rank]).index(rank)

    def rail(self, local: int) -> tuple[int, ...]:
        """Global ranks with local index `local`, one per node, ascending."""
        return tuple(sorted(self.node_ranks(n)[local] for n in range(self.num_nodes)))

    def slot_ranks(self, local: int) -> torch.Tensor:
        """int64 [G, P]: row g lists the ranks of the node that slot g of rail `local` lives on."""
        ranks = [self.node_ranks(self.node_of_rank[r]) for r in self.rail(local)]
        return torch.tensor(ranks, dtype=torch.int64, device="cpu")


def tokens_per_slot(is_token_in_rank_NR: torch.Tensor, slot_ranks_GV: torch.Tensor) -> torch.Tensor:
    """bool [N, G]: whether token n needs any rank of the node in rail slot g.

    Example (slots hold ranks [[0, 1], [2, 3]]): a token for ranks {1, 3} -> [True, True];
    for ranks {2, 3} -> [False, True] (it crosses to that node once, not twice).
    """
    G, P = slot_ranks_GV.shape
    N = is_token_in_rank_NR.shape[0]
    return is_token_in_rank_NR[:, slot_ranks_GV.flatten()].view(N, G, P).any(dim=2)

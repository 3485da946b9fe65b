"""How far each rank is from each other rank, and what a (token, expert) pair costs at each distance.

Distance classes run 0 (same rank), 1 (same node), 2 (another node), and further classes for
racks and tiers above, as in `ubep.topology`. The traffic cost of a pair that travels class c is
`cost_C[c]`: nothing on the rank, a little inside a node (the rank's copy engine or the node's
switch), one unit across a node boundary and one more per tier above it. The placement uses the
cost as a tie-breaker under its load bound; `measure` reports bytes, not costs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ubep.topology import Topology

SAME_NODE_COST = 1 / 16  # a pair that stays in the node: cheap, but still worth keeping on the rank
NODE_CLASS = 2  # the first class that crosses a node boundary (0 rank, 1 node)


@dataclass(frozen=True, slots=True, eq=False)
class Distances:
    """Distance classes between R ranks; class >= `node_class` crosses a node boundary."""

    class_RR: np.ndarray  # int64 [R, R]
    node_class: int = NODE_CLASS

    @classmethod
    def from_nodes(cls, node_of_rank: tuple[int, ...] | list[int]) -> Distances:
        """Three classes: the same rank, the same node, another node."""
        node_R = np.asarray(node_of_rank, dtype=np.int64)
        same_node_RR = node_R[:, None] == node_R[None, :]
        class_RR = np.where(same_node_RR, 1, 2)
        np.fill_diagonal(class_RR, 0)
        return cls(class_RR.astype(np.int64))

    @classmethod
    def from_topology(cls, topo: Topology, num_ranks: int) -> Distances:
        """The topology's classes (level 1 is the node: `ubep.topology`'s superpods and HGX)."""
        return cls(topo.class_matrix(num_ranks).astype(np.int64))

    @property
    def num_ranks(self) -> int:
        return self.class_RR.shape[0]

    def node_of_rank(self) -> np.ndarray:
        """int64 [R]: node index of each rank (ranks within a class below `node_class` share a node)."""
        near_RR = self.class_RR < self.node_class
        return np.argmax(near_RR, axis=1)  # the first rank of each rank's node names the node

    def cost_C(self) -> np.ndarray:
        """float [C]: traffic cost of one pair by the class it travels."""
        C = int(self.class_RR.max()) + 1
        classes = np.arange(max(C, self.node_class + 1))
        return np.where(
            classes == 0,
            0.0,
            np.where(classes < self.node_class, SAME_NODE_COST, 1.0 + classes - self.node_class),
        )

    def cost_RR(self) -> np.ndarray:
        """float [R, R]: traffic cost of one pair from rank s to rank d."""
        return self.cost_C()[self.class_RR]

"""DeepEP 2.1's `deep_ep.utils.envs` domain sizes, from ubep's node map of the group.

Physical domain: (RDMA ranks, NVLink ranks) in DeepEP's words, here (nodes, ranks per node),
where a node is a host or one of torchrun's node groups (`LocalLaunch(ranks_per_node=...)`
emulates them). Logical domain: (scale-out ranks, scale-up ranks), the physical one in hybrid
mode, else (1, R). DeepEP's GPU-setup helpers in that module (`init_dist`, NVLink and RDMA
probes) are not provided.
"""

from __future__ import annotations

import torch.distributed as dist

from ubep.group import join_group


def domain_of(node_of_rank: tuple[int, ...] | list[int]) -> tuple[int, int]:
    """(nodes, ranks per node) of a node map; nodes must hold consecutive, equal blocks of ranks."""
    num_ranks, num_nodes = len(node_of_rank), len(set(node_of_rank))
    per_node = num_ranks // num_nodes
    blocks = all(node == r // per_node for r, node in enumerate(node_of_rank))
    if not blocks or per_node * num_nodes != num_ranks:
        raise ValueError(
            f"ranks must fill nodes in equal consecutive blocks (rank = node * ranks_per_node + local), "
            f"got node of each rank {list(node_of_rank)}"
        )
    return num_nodes, per_node


def get_physical_domain_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(nodes, ranks per node) of `group`. Collective, unlike DeepEP's: every rank calls it at once."""
    return domain_of(join_group(group).node_of_rank)


def get_logical_domain_size(
    group: dist.ProcessGroup | None, allow_hybrid_mode: bool = True
) -> tuple[int, int]:
    """(scale-out ranks, scale-up ranks): the physical domain with `allow_hybrid_mode`, else (1, R).
    Collective, like `get_physical_domain_size`."""
    nodes, per_node = get_physical_domain_size(group)
    return (nodes, per_node) if allow_hybrid_mode else (1, nodes * per_node)

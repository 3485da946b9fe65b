"""Where elastic EP is watched and soaked (issue 43, items 6 and 7): a placement that holds every
expert on two hosts, so a host's death leaves a live copy of each, and what survivors check.

    copied_placement(E, hosts, ranks_per_host, L) -> Placement   expert e on hosts e % H and (e + 1) % H
    lost_bounds(placement, masked, topk_idx)      -> (must be left out, may be left out)  [N, K] bool

Legend: see `ubep.layout`; here also L slots per rank and U = R * L physical experts.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ubep.placement import Placement


def copied_placement(num_logical: int, hosts: int, ranks_per_host: int, slots_per_rank: int) -> Placement:
    """Expert e on hosts e % hosts and (e + 1) % hosts (one rank of each), a host's spare slots given
    to experts it does not hold yet (a third copy), never two copies of one expert on one rank.

    Example: 6 experts, 3 hosts of 1 rank, 4 slots: host 0 holds 0, 2, 3, 5 (e % 3 in {0, 2}).
    """
    if hosts < 2:
        raise ValueError(f"copied_placement: an expert on two hosts needs hosts >= 2, got {hosts}")
    per_host = ranks_per_host * slots_per_rank
    logical_U: list[int] = []
    for host in range(hosts):
        held = [e for e in range(num_logical) if host in (e % hosts, (e + 1) % hosts)]
        spare = [e for e in range(num_logical) if e not in set(held)]
        if len(held) > per_host or len(held) + len(spare) < per_host:
            raise ValueError(f"copied_placement: host {host} holds {len(held)} experts in {per_host} slots")
        chosen = held + spare[: per_host - len(held)]
        # deal round robin over the host's ranks: two copies on one host land on different ranks
        for rank in range(ranks_per_host):
            logical_U += chosen[rank::ranks_per_host][:slots_per_rank]
    return Placement.from_list(logical_U, hosts * ranks_per_host, num_logical)


def lost_bounds(
    placement: Placement, masked: Iterable[int], topk_idx_NK: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [N, K] twice: the entries of logical `topk_idx_NK` whose every copy is on a masked rank
    (no copy can take them: they must be left out), and those with a copy there (they may be left
    out: without copies taking over, the entries routed to the dead copy are)."""
    masked_R = torch.zeros(placement.num_ranks, dtype=torch.bool, device="cpu")
    masked_R[sorted(masked)] = True
    copies_EJ = placement.physical_of_logical_EJ()
    dead_EJ = torch.where(copies_EJ >= 0, masked_R[copies_EJ.clamp(min=0) // placement.slots_per_rank], False)
    live_EJ = (copies_EJ >= 0) & ~dead_EJ
    valid_NK = topk_idx_NK >= 0
    idx_NK = topk_idx_NK.clamp(min=0).cpu()
    must_NK = valid_NK & ~live_EJ.any(dim=1)[idx_NK].to(valid_NK.device)
    may_NK = valid_NK & dead_EJ.any(dim=1)[idx_NK].to(valid_NK.device)
    return must_NK, may_NK

"""The layout helpers run on topk_idx's device with no host read, proven on CPU with the meta device.

A meta tensor has a shape and a device but no data: `.item()`, boolean indexing and bincount raise on
it, and `OnlyOn` fails every op that touches a tensor on another device (a CPU table indexed by a
meta index runs silently otherwise). What passes here runs on a GPU without a host sync and without
mixing devices. The values are checked on CPU against a plain Python loop over tokens, including
-1 slots and ids outside [0, E), which count as "no expert" (callers check values elsewhere).
`Buffer.get_dispatch_layout` with `capturable` is run with every host read made to fail.
"""

from __future__ import annotations

import pytest
import torch
from test_ll_device import HostSync, _no_host_reads, _restore
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import ubep
from ubep.layout import ExpertPlacement, dispatch_layout, token_in_rank, tokens_per_node

META = torch.device("meta")


class OnlyOn(TorchDispatchMode):
    """Fails any op whose tensor inputs or outputs are not all on `device`."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        elsewhere = {
            str(t.device)
            for t in tree_leaves((args, kwargs, out))
            if isinstance(t, torch.Tensor) and t.device != self.device
        }
        assert not elsewhere, f"{func} touched tensors on {sorted(elsewhere)}, not only on {self.device}"
        return out


def on_meta(placement: ExpertPlacement) -> ExpertPlacement:
    """The placement's tables on the meta device (built by hand: independent of ExpertPlacement.to)."""
    return ExpertPlacement(
        placement.num_ranks, placement.rank_of_expert_E.to(META), placement.local_index_E.to(META)
    )


# ---- no host read, no device mixing (meta) --------------------------------------------------------


@pytest.mark.parametrize("N", [0, 5])
def test_dispatch_layout_on_meta(N):
    placement = on_meta(ExpertPlacement.contiguous(8, 4))
    idx_NK = torch.empty(N, 3, dtype=torch.int64, device=META)
    with OnlyOn(META):
        in_rank_NR = token_in_rank(idx_NK, placement)
        got = dispatch_layout(idx_NK, placement)
    assert (in_rank_NR.device, in_rank_NR.shape, in_rank_NR.dtype) == (META, (N, 4), torch.bool)
    assert (got.num_tokens_per_rank_R.device, got.num_tokens_per_rank_R.shape) == (META, (4,))
    assert (got.num_tokens_per_expert_E.device, got.num_tokens_per_expert_E.shape) == (META, (8,))
    assert got.num_tokens_per_rank_R.dtype == got.num_tokens_per_expert_E.dtype == torch.int32
    assert (got.is_token_in_rank_NR.shape, got.is_token_in_rank_NR.dtype) == ((N, 4), torch.bool)


@pytest.mark.parametrize("node_of_rank", [(0, 0, 1, 1), (0, 1, 0, 1), (1, 1, 0, 2)])
def test_tokens_per_node_on_meta(node_of_rank):
    in_rank_NR = torch.empty(6, 4, dtype=torch.bool, device=META)
    with OnlyOn(META):
        per_node_G = tokens_per_node(in_rank_NR, node_of_rank)
    G = max(node_of_rank) + 1
    assert (per_node_G.device, per_node_G.shape, per_node_G.dtype) == (META, (G,), torch.int32)


def test_placement_moves_and_mixed_devices_are_refused():
    placement = ExpertPlacement.from_ranks([1, 0, 0, 1], 2)
    assert placement.to("cpu") is placement  # already there: no copy
    moved = placement.to(META)
    assert moved.rank_of_expert_E.device == moved.local_index_E.device == META
    assert (moved.num_ranks, moved.num_experts) == (2, 4)
    with pytest.raises(ValueError, match=r"topk_idx is on meta.*placement.to\(topk_idx.device\)"):
        token_in_rank(torch.empty(3, 2, dtype=torch.int64, device=META), placement)


# ---- values, against a loop over tokens (CPU) -----------------------------------------------------


def loop_layout(idx_NK: torch.Tensor, owner_E: list[int], R: int):
    """(per rank, per expert, in_rank rows) by a plain loop; ids outside [0, E) are no expert."""
    E = len(owner_E)
    in_rank = [[False] * R for _ in range(idx_NK.shape[0])]
    per_expert = [0] * E
    for n, row in enumerate(idx_NK.tolist()):
        for e in row:
            if 0 <= e < E:
                in_rank[n][owner_E[e]] = True
                per_expert[e] += 1
    per_rank = [sum(row[r] for row in in_rank) for r in range(R)]
    return per_rank, per_expert, in_rank


def routing(N: int, K: int, E: int, seed: int) -> torch.Tensor:
    """Distinct experts per row, then some -1 slots, some ids past E and below -1, a repeated row."""
    gen = torch.Generator().manual_seed(seed)
    idx_NK = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(N)]) if N else torch.empty(0, K)
    idx_NK = idx_NK.to(torch.int64)
    if N:
        pick_NK = torch.rand(N, K, generator=gen)
        idx_NK[pick_NK < 0.2] = -1
        idx_NK[(pick_NK >= 0.2) & (pick_NK < 0.27)] = E + 3
        idx_NK[(pick_NK >= 0.27) & (pick_NK < 0.3)] = E
        idx_NK[(pick_NK >= 0.3) & (pick_NK < 0.32)] = -5
        idx_NK[N // 2] = idx_NK[0]  # a repeated row
    return idx_NK


PLACEMENTS = {
    "contiguous": lambda: ExpertPlacement.contiguous(12, 4),
    "explicit": lambda: ExpertPlacement.from_ranks([3, 0, 2, 1, 0, 3, 1, 2, 2, 0, 3, 1], 4),
}


@pytest.mark.parametrize("N", [0, 1, 9, 40])
@pytest.mark.parametrize("kind", sorted(PLACEMENTS))
def test_dispatch_layout_matches_a_loop(N, kind):
    placement = PLACEMENTS[kind]()
    idx_NK = routing(N, 3, placement.num_experts, seed=N)
    per_rank, per_expert, in_rank = loop_layout(idx_NK, placement.rank_of_expert_E.tolist(), 4)
    got = dispatch_layout(idx_NK, placement)
    assert got.num_tokens_per_rank_R.dtype == got.num_tokens_per_expert_E.dtype == torch.int32
    assert got.num_tokens_per_rank_R.tolist() == per_rank
    assert got.num_tokens_per_expert_E.tolist() == per_expert
    assert got.is_token_in_rank_NR.tolist() == in_rank
    assert token_in_rank(idx_NK, placement).tolist() == in_rank


@pytest.mark.parametrize(
    "node_of_rank", [(0, 0, 1, 1, 2, 2), (0, 1, 2, 0, 1, 2), (2, 2, 0, 1, 1, 0), (0,) * 6]
)
@pytest.mark.parametrize("N", [0, 30])
def test_tokens_per_node_matches_a_loop(node_of_rank, N):
    gen = torch.Generator().manual_seed(N + 1)
    in_rank_NR = torch.rand(N, 6, generator=gen) < 0.3
    G = max(node_of_rank) + 1
    want = [0] * G
    for row in in_rank_NR.tolist():
        for g in set(node_of_rank[r] for r in range(6) if row[r]):
            want[g] += 1
    got = tokens_per_node(in_rank_NR, node_of_rank)
    assert got.dtype == torch.int32 and got.tolist() == want


# ---- Buffer.get_dispatch_layout ---------------------------------------------------------------------


def test_get_dispatch_layout_checks_values_unless_capturable():
    """Without `capturable`, get_dispatch_layout checks topk_idx's values on the host (a read the guard
    sees). With it (Triton halves on a heap), it reads nothing back and ids outside [0, E) count as no
    expert: test_ubep_device's whole capturable Buffer call checks that."""
    E = 8
    idx_NK = routing(10, 3, E, seed=7)
    with ubep.Buffer(hidden=16, num_experts=E, max_tokens_per_rank=16, low_latency=False) as buf:
        with pytest.raises(ValueError, match=r"topk_idx values must lie in \[-1, 8\)"):
            buf.get_dispatch_layout(idx_NK, E)
        patched = []
        _no_host_reads(patched)
        try:
            with pytest.raises(HostSync):  # the guard sees the value check's reads
                buf.get_dispatch_layout(idx_NK.clamp(-1, E - 1), E)
        finally:
            _restore(patched)

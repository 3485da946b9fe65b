"""How much shared memory a Buffer takes, before constructing it.

The bytes come from the same blocks and layout the transports build their
segments from (`ubep.factory.heap_layout`; the hierarchical transport's own
blocks), so the answer is exact, not an estimate. On one host every
rank maps one segment of `segment_bytes`, sparse: a page is taken once touched,
and calls can touch at most `touchable_bytes` of it (the low-latency slots hold
T rows for every (source, local expert), of which one call fills at most
T * min(K, L) per source: `ubep.protocols.ll.blocks.LLBlocks.of`). The host's
/dev/shm, the memory cgroup (if it has a limit) and the host's available memory
must each hold `host_touchable_bytes`, which is what construction checks
(`ubep.transport.segments.check_room`; docs/reliability.md, "Footprint"). Example:
8 ranks, H = 7168, T = 128, 256 experts, top-8: `size_hint(hidden=7168,
num_experts=256, max_tokens_per_rank=128, num_ranks=8, max_topk=8).host_touchable_bytes`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ubep import validate
from ubep.across.collectives.bsp_hier import HierBlocks
from ubep.factory import heap_layout
from ubep.layout import ExpertPlacement
from ubep.protocols.base import Sizing
from ubep.registry import PROTOCOLS, UBEP, one_of
from ubep.transport.heap import Layout


class SizeHint(NamedTuple):
    """Shared memory of one Buffer: each rank's segment (mapped) and the most of it calls can touch
    (what construction checks), and the same for all of one host's segments."""

    segment_bytes: int
    ranks_per_host: int
    touchable_bytes: int

    @property
    def host_bytes(self) -> int:
        return self.segment_bytes * self.ranks_per_host

    @property
    def host_touchable_bytes(self) -> int:
        return self.touchable_bytes * self.ranks_per_host


def size_hint(
    *,
    hidden: int,
    num_experts: int,
    max_tokens_per_rank: int,
    num_ranks: int,
    protocol: str = UBEP.name,
    max_topk: int = 16,
    low_latency: bool = False,
    expert_placement: list[int] | torch.Tensor | None = None,
    num_nodes: int = 1,
    ll_flag: str = "after-data",
) -> SizeHint:
    """The shared memory a Buffer with these arguments maps, and can touch, for a group of
    `num_ranks` ranks on `num_nodes` hosts (more than one: the hierarchical transport, whose
    low-latency path runs over torch.distributed and takes no shared memory). `low_latency`:
    with the low-latency slots (a Buffer's default is without). `ll_flag="in-word"`:
    low-latency slots hold rows as epoch words, twice the bytes."""
    for name, value in (
        ("hidden", hidden),
        ("num_experts", num_experts),
        ("num_ranks", num_ranks),
        ("max_tokens_per_rank", max_tokens_per_rank),
        ("max_topk", max_topk),
        ("num_nodes", num_nodes),
    ):
        validate.positive(name, value)
    one_of("protocol", PROTOCOLS, protocol, auto=False)
    if num_ranks % num_nodes:
        raise ValueError(f"num_ranks ({num_ranks}) must be a multiple of num_nodes ({num_nodes})")
    placement = (
        ExpertPlacement.contiguous(num_experts, num_ranks)
        if expert_placement is None
        else ExpertPlacement.from_ranks(expert_placement, num_ranks)
    )
    sizing = Sizing(hidden=hidden, capacity=max_tokens_per_rank, max_topk=max_topk, placement=placement)
    per_host = num_ranks // num_nodes
    if num_nodes > 1:
        layout = Layout(per_host, HierBlocks.of(sizing, num_nodes, per_host).all())
    else:
        layout = heap_layout(sizing, protocol, low_latency, ll_flag)
    return SizeHint(layout.nbytes, per_host, layout.touchable)

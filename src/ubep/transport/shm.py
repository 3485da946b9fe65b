"""Shared segments as a `Heap`'s memory: the ranks are processes of one host.

The segments themselves (creation, mapping, unlinking, the stale sweep) are
`ubep.transport.segments`; a sleeping peer is woken through its doorbell (`ubep.doorbell`).
Plain loads and stores into the mappings are the puts, signals and waits; the
memory-ordering argument is in docs/design.md.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from ubep.doorbell import Doorbell
from ubep.transport.base import Header, Region
from ubep.transport.heap import Heap, Layout
from ubep.transport.segments import SegmentLayout, SymmetricHeap


class SharedSegments:
    """Every rank's segment mapped here, and the doorbells (the `Memory` of a host's heap)."""

    def __init__(self, layout: Layout, group: dist.ProcessGroup, rank: int, world_size: int):
        segment = SegmentLayout()
        segment.add("arena", (layout.nbytes,), torch.uint8)
        self._segments = SymmetricHeap(segment, group, rank, world_size, touchable=layout.touchable)
        try:
            self._doorbell = Doorbell(self._segments.names[rank], self._segments.doorbell_key)
        except BaseException:
            self._segments.close()
            raise
        self._doorbell.connect(self._segments.names)
        self.creators = self._segments.creators  # each rank's process, for liveness checks

    def arena(self, owner: int) -> torch.Tensor:
        return self._segments.tensor(owner, "arena")

    def ring(self, peer: int) -> None:
        self._doorbell.ring(peer)

    def sleep(self, timeout_s: float) -> None:
        self._doorbell.wait(timeout_s)

    def close(self) -> None:
        self._doorbell.close()
        self._segments.close()


def shm_heap(
    blocks: Iterable[Region | Header], group: dist.ProcessGroup, rank: int, world_size: int, timeout_s: float
) -> Heap:
    """Collective: every rank of `group` maps every rank's segment holding `blocks`."""
    layout = Layout(world_size, blocks)
    segments = SharedSegments(layout, group, rank, world_size)
    heap = Heap(layout, segments, rank, world_size, timeout_s)
    heap.learn_peers(segments.creators)
    dist.barrier(group=group)  # every doorbell is ready before the first wait
    return heap

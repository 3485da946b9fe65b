"""The CUDA heap: the transport interface with payload regions in torch symmetric memory.

    routing -> layout -> schedule -> protocol -> engine -> [transport: cuda]

The GPUs of one heap share a host (across hosts the hierarchical transport
crosses with torch.distributed). So the part of a heap the host waits on, the
headers, the control block (pids, barrier, abort notices) and any region named
in `host_regions` (counters a protocol polls with `words`), stays in the host's
shared segments: the one tested `Heap` with its wait loop, deadlines and abort
notices. Every other region lives in one symmetric CUDA allocation per rank
(`torch.distributed._symmetric_memory`: `empty`, then `rendezvous`), and `view`
returns a CUDA tensor over any peer's copy (`get_buffer`): kernels read and
write peers' memory directly, and `pointer_table` gives one launch every peer.

Ordering (docs/device.md): `publish` waits for this rank's current stream
before it stamps the header, so every kernel that wrote the payload, into
whichever GPU, has completed; a reader that sees the stamp launches its kernels
after that. Device-side flags (the engine's `put_rows_flag` / `pack_put`) are
for protocols that wait inside kernels; they live in regions declared here,
never in torch's signal pads, which torch's own barrier uses.

Nothing here imports symmetric memory until a heap is built, so the CPU build
of torch imports this module cleanly. Not run here (no GPU); see docs/device.md.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ubep.calls import CallId
from ubep.errors import PeerDataError
from ubep.transport.base import Agreement, Header, Record, Region
from ubep.transport.heap import Heap, Layout
from ubep.transport.shm import shm_heap


class CudaHeap:
    """The transport interface (`ubep.transport.base.Transport`): a host `Heap` plus device regions."""

    def __init__(
        self, host: Heap, layout: Layout, arena: torch.Tensor, handle, device_regions: Iterable[str]
    ):
        self.rank, self.num_ranks = host.rank, host.num_ranks
        self._host, self._layout, self._handle = host, layout, handle
        self._device_regions = frozenset(device_regions)
        self._arenas = [
            arena if r == self.rank else handle.get_buffer(r, (layout.nbytes,), torch.uint8)
            for r in range(self.num_ranks)
        ]
        self._tables: dict[tuple[str, int], torch.Tensor] = {}

    def view(self, region: Region, owner: int, call: CallId | None = None) -> torch.Tensor:
        if region.name not in self._device_regions:
            return self._host.view(region, owner, call)
        offset, shape, dtype = self._layout.offsets[(region.name, _half(region, call))]
        nbytes = int(np.prod(shape)) * dtype.itemsize
        return self._arenas[owner][offset : offset + nbytes].view(dtype).view(shape)

    @property
    def device(self) -> torch.device:
        """The device of this rank's arena (where compiled call halves' tensors must live)."""
        return self._arenas[self.rank].device

    def address_table(self, blocks: Sequence[Region | Header]) -> tuple[np.ndarray, np.ndarray]:
        """(table int64 [R, len(blocks), 2], asleep int64 [R]) as `Heap.address_table`: every block's
        device address in every rank's arena for both halves, for kernels that reach peers' memory
        directly (`ubep.protocols.ll.triton_driver`). Every block must live on the device (headers named in
        `device_headers`); no rank sleeps on a device word, so `asleep` is all zeros."""
        on_host = [b.name for b in blocks if b.name not in self._device_regions]
        if on_host:
            raise ValueError(f"blocks {on_host} live in host memory; a device address table needs them on "
                             "the device (cuda_heap's device_headers)")  # fmt: skip
        table = np.empty((self.num_ranks, len(blocks), 2), dtype=np.int64)
        for r in range(self.num_ranks):
            base = self._arenas[r].data_ptr()
            for b, block in enumerate(blocks):
                for half in (0, 1):
                    offset = self._layout.offsets[(block.name, half if block.double else 0)][0]
                    table[r, b, half] = base + offset
        return table, np.zeros(self.num_ranks, dtype=np.int64)

    def sleeper(self, phase: str, call: CallId):
        return self._host.sleeper(phase, call)

    def pointer_table(self, region: Region, call: CallId | None = None) -> torch.Tensor:
        """int64 [R] on the device: `region`'s address in every rank's memory (for one-launch gathers)."""
        key = (region.name, _half(region, call))
        table = self._tables.get(key)
        if table is None:
            addresses = [self.view(region, r, call).data_ptr() for r in range(self.num_ranks)]
            table = self._tables[key] = torch.tensor(
                addresses, dtype=torch.int64, device=self._arenas[0].device
            )
        return table

    def publish(
        self, header: Header, call: CallId, values: Mapping[str, int | Iterable[int]], to: int | None = None
    ) -> None:
        torch.cuda.current_stream(self._arenas[0].device).synchronize()  # the payload kernels are done
        self._host.publish(header, call, values, to)

    def arrivals(self, header: Header, call: CallId, peers: Iterable[int], phase: str) -> Iterator[list[int]]:
        return self._host.arrivals(header, call, peers, phase)

    def landed(self, header: Header, call: CallId, peers: Iterable[int], phase: str) -> Iterator[int]:
        return self._host.landed(header, call, peers, phase)

    def wait_landed(self, header: Header, call: CallId, peers: Iterable[int], phase: str) -> None:
        self._host.wait_landed(header, call, peers, phase)

    def stamped(self, header: Header, call: CallId, peer: int) -> bool:
        return self._host.stamped(header, call, peer)

    def read(self, header: Header, call: CallId, peer: int) -> Record:
        return self._host.read(header, call, peer)

    def read_all(self, header: Header, call: CallId, peers: Sequence[int]) -> Record:
        return self._host.read_all(header, call, peers)

    def wait(self, phase: str, call: CallId, peers: Iterable[int], ready: Callable[[int], bool]) -> None:
        self._host.wait(phase, call, peers, ready)

    def words(self, region: Region, owner: int) -> np.ndarray:
        if region.name in self._device_regions:
            raise TypeError(f"region {region.name} lives on the device; name it in host_regions to poll it")
        return self._host.words(region, owner)

    def ring(self, peer: int | None = None) -> None:
        self._host.ring(peer)

    def barrier(self, phase: str, call: CallId) -> None:
        torch.cuda.current_stream(self._arenas[0].device).synchronize()  # as publish: our writes are done
        self._host.barrier(phase, call)

    def begin(self, call: CallId) -> None:
        self._host.begin(call)

    def check_in_step(self, call: CallId, phase: str) -> None:
        self._host.check_in_step(call, phase)

    def abort(self, call: CallId, cause: int = 0, culprit: int = -1) -> None:
        self._host.abort(call, cause, culprit)

    def bad_data(self, call: CallId, culprit: int, message: str) -> PeerDataError:
        return self._host.bad_data(call, culprit, message)

    @property
    def live(self) -> tuple[int, ...]:
        return self._host.live

    def mask(self, ranks: Collection[int], seq: int) -> int:
        return self._host.mask(ranks, seq)

    def agree_to_mask(self, error: Exception, seq: int) -> Agreement | None:
        return self._host.agree_to_mask(error, seq)

    def agree(self, value: int, phase: str) -> dict[int, int]:
        return self._host.agree(value, phase)

    def check_member(self, phase: str, peers: Iterable[int] | None = None) -> None:
        self._host.check_member(phase, peers)

    def close(self) -> None:
        self._arenas, self._tables, self._handle = [], {}, None  # symmetric memory is freed with its tensors
        self._host.close()


def cuda_heap(
    blocks: Iterable[Region | Header],
    group: dist.ProcessGroup,
    rank: int,
    world_size: int,
    timeout_s: float,
    device: torch.device,
    host_regions: Collection[str] = (),
    device_headers: Collection[str] = (),
) -> CudaHeap:
    """Collective: every rank of `group` (one GPU each, one host) allocates and maps every rank's memory.

    Headers stay in host memory unless named in `device_headers`: those are laid out in the device
    arena like a region (stamp first), for protocols whose kernels stamp and poll them there."""
    if not torch.cuda.is_available() or torch.device(device).type != "cuda":
        raise ValueError(f"the CUDA heap needs a CUDA device, got {device} (CUDA available: "
                         f"{torch.cuda.is_available()})")  # fmt: skip
    from torch.distributed import _symmetric_memory as symm_mem

    blocks = list(blocks)
    on_device = [
        b for b in blocks
        if (isinstance(b, Region) and b.name not in host_regions) or b.name in device_headers
    ]  # fmt: skip
    host = shm_heap([b for b in blocks if b not in on_device], group, rank, world_size, timeout_s)
    try:
        layout = Layout(world_size, on_device)
        arena = symm_mem.empty(layout.nbytes, dtype=torch.uint8, device=device)
        arena.zero_()  # device flags start at 0 (no epoch is 0)
        symm_mem.enable_symm_mem_for_group(group.group_name)  # needed by older torch; a no-op when done
        handle = symm_mem.rendezvous(arena, group.group_name)
        torch.cuda.synchronize(device)
        dist.barrier(group=group)  # nobody writes into a peer's arena before the peer zeroed it
        return CudaHeap(host, layout, arena, handle, (r.name for r in on_device))
    except BaseException:
        host.close()
        raise


def _half(region: Region, call: CallId | None) -> int:
    if not region.double:
        return 0
    if call is None:
        raise ValueError(f"region {region.name} is double-buffered: view it for a call")
    return call.parity

"""The symmetric heap: one POSIX shared-memory segment per rank, mapped by every rank.

Each rank creates its segment (mode 0600, an unguessable name carrying its pid),
the group exchanges names, every rank maps every segment, and once all have
mapped, each rank unlinks its own name. From then on the memory lives exactly
as long as some rank maps it: no crash, kill or forgotten `close()` can leave a
segment behind. The only window for a leak is construction itself, and there
`sweep_stale_segments` (run by every construction) removes segments whose
creator has died.

Put, signal and wait are plain loads and stores into these mappings; see
docs/design.md for the memory-ordering argument.
"""

from __future__ import annotations

import math
import mmap
import os
import secrets
import stat
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from ubep.waiting import AbortNotice, PeerAbortedError

SHM_DIR = "/dev/shm"
NAME_PREFIX = "ubep-"
ALIGN = 64  # bytes; regions start on cache-line boundaries


@dataclass(frozen=True, slots=True)
class Region:
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


@dataclass(slots=True)
class SegmentLayout:
    """Named, aligned regions of a segment; every rank's segment has the same layout."""

    regions: dict[str, Region] = field(default_factory=dict)
    nbytes: int = 0

    def add(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        offset = -(-self.nbytes // ALIGN) * ALIGN
        shape = tuple(int(s) for s in shape)
        region = Region(offset, shape, dtype, math.prod(shape) * dtype.itemsize)
        self.regions[name] = region
        self.nbytes = offset + region.nbytes


def segment_name(pid: int) -> str:
    return f"{NAME_PREFIX}{pid}-{secrets.token_hex(12)}"


def segment_pid(name: str) -> int | None:
    """The creator's pid encoded in one of our segment names, or None."""
    if not name.startswith(NAME_PREFIX):
        return None
    head = name[len(NAME_PREFIX) :].split("-", 1)[0]
    return int(head) if head.isdigit() else None


def sweep_stale_segments(pids: set[int] | None = None) -> list[str]:
    """Unlink our segments whose creator has exited (or, given `pids`, was one of them).

    Returns the names removed. Only segments owned by this user are touched.
    """
    from ubep.waiting import process_alive

    removed = []
    for name in os.listdir(SHM_DIR):
        pid = segment_pid(name)
        if pid is None:
            continue
        stale = pid in pids if pids is not None else not process_alive(pid)
        path = os.path.join(SHM_DIR, name)
        try:
            if stale and os.stat(path).st_uid == os.getuid():
                os.unlink(path)
                removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def _create(name: str, nbytes: int) -> mmap.mmap:
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, max(nbytes, 1))
        return mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED)
    finally:
        os.close(fd)


def _attach(name: str, nbytes: int) -> mmap.mmap:
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW)
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
            raise PermissionError(f"shared segment {name} has an unexpected owner or mode")
        if info.st_size < nbytes:
            raise ValueError(f"shared segment {name} is {info.st_size} bytes, expected {nbytes}")
        return mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED)
    finally:
        os.close(fd)


def _attach_peer(rank: int, name: str, nbytes: int) -> mmap.mmap:
    """Map peer `rank`'s segment; if its name is gone, that peer gave up during construction."""
    try:
        return _attach(name, nbytes)
    except FileNotFoundError:
        notice = AbortNotice("its shared segment was gone before this rank mapped it; see that rank's error")
        raise PeerAbortedError("Buffer construction (mapping segments)", rank, notice) from None


class SymmetricHeap:
    """Every rank's segment, mapped here; built collectively over `group`."""

    def __init__(self, layout: SegmentLayout, group: dist.ProcessGroup, rank: int, world_size: int):
        self.layout = layout
        self.rank = rank
        self.world_size = world_size
        self._maps: list[mmap.mmap] = []
        sweep_stale_segments()
        own = segment_name(os.getpid())
        names: list[str] = [""] * world_size
        try:
            self._own_map = _create(own, layout.nbytes)
            dist.all_gather_object(names, own, group=group)
            self._maps = [
                self._own_map if r == rank else _attach_peer(r, n, layout.nbytes) for r, n in enumerate(names)
            ]
            dist.barrier(group=group)  # everyone mapped everything: names can go
        except BaseException:
            self._unlink(own)
            self.close()
            sweep_stale_segments()  # a peer that died here leaves its name behind
            raise
        self._unlink(own)
        self.names = names  # every rank's segment name (unlinked by now; unique and unguessable)
        self._words = [np.frombuffer(m, dtype=np.int64) for m in self._maps]
        self._bytes = [torch.frombuffer(m, dtype=torch.uint8) for m in self._maps]
        self._views: dict[tuple[int, str], torch.Tensor] = {}
        self._word_views: dict[tuple[int, str], np.ndarray] = {}

    @staticmethod
    def _unlink(name: str) -> None:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass

    def tensor(self, rank: int, name: str) -> torch.Tensor:
        """Region `name` of `rank`'s segment as a tensor of its declared shape and dtype."""
        view = self._views.get((rank, name))
        if view is None:
            region = self.layout.regions[name]
            raw = self._bytes[rank][region.offset : region.offset + region.nbytes]
            view = self._views[(rank, name)] = raw.view(region.dtype).view(region.shape)
        return view

    def words(self, rank: int, name: str) -> np.ndarray:
        """An int64 region of `rank`'s segment as a numpy array, for flags and counts.

        Single-element loads and stores through numpy are plain 8-byte moves.
        """
        words = self._word_views.get((rank, name))
        if words is None:
            region = self.layout.regions[name]
            if region.dtype != torch.int64:
                raise TypeError(f"region {name} holds {region.dtype}, not int64 words")
            start, count = region.offset // 8, region.nbytes // 8
            words = self._words[rank][start : start + count].reshape(region.shape)
            self._word_views[(rank, name)] = words
        return words

    def close(self) -> None:
        """Drop every mapping; idempotent. Views handed out must not be used afterwards."""
        self._words = []
        self._bytes = []
        self._views = {}
        self._word_views = {}
        maps, self._maps = self._maps, []
        for m in maps:
            try:
                m.close()
            except BufferError:
                pass  # a tensor view still exists; the mapping goes when it does

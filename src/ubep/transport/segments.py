"""The symmetric heap: one POSIX shared-memory segment per rank, mapped by every rank.

Construction, over `group`, in three all-gathers:

    1. introduce  every rank's identity (pid, PID namespace, start time), a random
                  token, and the room it sees (/dev/shm free, cgroup headroom).
                  What calls can touch of the segments must fit the least room
                  any rank sees, or every rank raises `SharedMemorySizeError`
                  before a byte is allocated.
                  The tokens make the job's secret: segment names and doorbell
                  addresses derive from it, so no outsider can guess or squat them.
    2. create     each rank creates its own segment (mode 0600); statuses gathered.
    3. map        each rank maps every segment; statuses gathered, then every rank
                  unlinks every name of the job.

A failure in step 2 or 3 is raised on every rank, naming the rank and its error;
a rank killed in between is named by the Buffer's construction deadline
(`ubep.deadlines`), which knows every rank's process from joining the group. Whatever
fails, every rank that learned the names unlinks all of them, so a killed
rank's name does not outlive the survivors. Once built, the memory lives exactly
as long as some rank maps it. Every rank keeps each segment's file open: a process restarted
in a dead rank's place maps them through a live rank's `/proc/PID/fd` (`attach_from`), since
the names are gone. `sweep_stale_segments` (run by every construction)
removes what a whole job killed mid-construction left behind: only segments whose
creator it can prove dead (same PID namespace, pid gone or reused).

Put, signal and wait are plain loads and stores into these mappings; see
docs/design.md for the memory-ordering argument.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import math
import mmap
import os
import secrets
import stat
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from ubep.errors import SharedMemorySizeError
from ubep.waiting import AbortNotice, PeerAbortedError, ProcessId, pid_namespace, start_time

SHM_DIR = "/dev/shm"
MEMINFO = "/proc/meminfo"
CGROUP_ROOT = "/sys/fs/cgroup"
NAME_PREFIX = "ubep-"
ALIGN = 64  # bytes; regions start on cache-line boundaries
NO_LIMIT = 1 << 62  # cgroup v1 writes "no limit" as a huge page-rounded number


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


# -- who made a segment, and whether it provably exited ------------------------------------------

Creator = ProcessId  # who created a segment: enough to prove it exited (see `ProcessId.is_gone`)


def segment_name(pid: int, token: str | None = None) -> str:
    """The name of a segment created by `pid` (a process in our PID namespace):
    `ubep-PID-PIDNS-START-TOKEN`, TOKEN 96 random bits unless given."""
    start = start_time("self" if pid == os.getpid() else str(pid)) or 0
    return _name(Creator(pid, pid_namespace(), start), token or secrets.token_hex(12))


def _name(creator: Creator, token: str) -> str:
    return f"{NAME_PREFIX}{creator.pid}-{creator.pid_ns}-{creator.start}-{token}"


def segment_creator(name: str) -> Creator | None:
    """The creator encoded in one of our segment names, or None (not ours, or an older format)."""
    if not name.startswith(NAME_PREFIX):
        return None
    fields = name[len(NAME_PREFIX) :].split("-", 3)
    if len(fields) != 4 or not all(f.isdigit() for f in fields[:3]) or not fields[3]:
        return None
    return Creator(int(fields[0]), int(fields[1]), int(fields[2]))


def segment_pid(name: str) -> int | None:
    """The creator's pid encoded in one of our segment names, or None."""
    creator = segment_creator(name)
    return creator.pid if creator is not None else None


def sweep_stale_segments(pids: set[int] | None = None) -> list[str]:
    """Unlink this user's segments whose creator provably exited (see `Creator.is_gone`), or,
    given `pids` (processes this one started and reaped), whose creator was one of them.

    Returns the names removed. Names in an older format, other users' segments and
    segments made in another PID namespace are never touched.
    """
    removed = []
    for name in os.listdir(SHM_DIR):
        creator = segment_creator(name)
        if creator is None:
            continue
        if pids is not None:
            stale = creator.pid in pids and creator.pid_ns == pid_namespace()
        else:
            stale = creator.is_gone()
        path = os.path.join(SHM_DIR, name)
        try:
            if stale and os.stat(path).st_uid == os.getuid():
                os.unlink(path)
                removed.append(name)
        except FileNotFoundError:
            pass
    return removed


# -- room for the segments ---------------------------------------------------------------------------


def shm_free_bytes() -> int:
    """Bytes an unprivileged process may still allocate in /dev/shm."""
    info = os.statvfs(SHM_DIR)
    return info.f_bavail * info.f_frsize


def memory_free_bytes(meminfo: str = MEMINFO) -> int | None:
    """What the host can still give a new page without killing anything: MemAvailable plus SwapFree
    (/proc/meminfo; a shared-memory page lives in RAM or swap). None where it cannot be read.

    /dev/shm is often as large as RAM (or larger, in containers), so its free bytes alone let
    segments through that would run the host out of memory once touched."""
    try:
        with open(meminfo) as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return sum(int(fields[key].split()[0]) * 1024 for key in ("MemAvailable", "SwapFree"))
    except (OSError, KeyError, ValueError):
        return None


def _headroom(directory: str, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    """limit - working set of one memory cgroup directory; None: no limit there (or unreadable).

    The working set is usage less the inactive file cache (`inactive_key` in memory.stat),
    which the kernel reclaims before it refuses a page: counting it would refuse Buffers
    in a container that merely read its model weights from disk."""
    try:
        with open(os.path.join(directory, limit_file)) as f:
            limit = f.read().strip()
        with open(os.path.join(directory, usage_file)) as f:
            usage = int(f.read())
    except (OSError, ValueError):
        return None
    if limit == "max" or not limit.isdigit() or int(limit) >= NO_LIMIT:
        return None
    return max(int(limit) - usage + _stat(directory, inactive_key), 0)


def _stat(directory: str, key: str) -> int:
    """One counter of a cgroup's memory.stat (0 if absent)."""
    try:
        with open(os.path.join(directory, "memory.stat")) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def cgroup_free_bytes(proc_cgroup: str = "/proc/self/cgroup", root: str = CGROUP_ROOT) -> int | None:
    """Memory this process's cgroup (and each ancestor) may still charge, the least of them
    (limit less working set, see `_headroom`); None: no limit. cgroup v2 (`memory.max`) and
    v1 (`memory.limit_in_bytes`) both charge shared-memory pages to the cgroup that first
    touches them."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base = root if os.path.exists(os.path.join(root, "cgroup.controllers")) else f"{root}/unified"
            files = ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            base = os.path.join(root, "memory")
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            room = _headroom(os.path.join(base, *parts[:depth]), *files)
            if room is not None:
                rooms.append(room)
    return min(rooms) if rooms else None


@dataclass(frozen=True, slots=True)
class Introduction:
    """What a rank tells its peers before any segment exists."""

    creator: Creator
    token: str  # random; all ranks' tokens make the job's secret
    shm_free: int
    cgroup_free: int | None
    memory_free: int | None = None  # `memory_free_bytes()`: the host's available memory

    @classmethod
    def here(cls) -> Introduction:
        return cls(
            Creator.this_process(),
            secrets.token_hex(16),
            shm_free_bytes(),
            cgroup_free_bytes(),
            memory_free_bytes(),
        )


KNOBS = (
    "lower max_tokens_per_rank or max_topk, or, where the Buffer makes no low-latency calls, "
    "build it without low_latency=True (ubep.sizing.size_hint tells the bytes before constructing)"
)


def check_room(segment_bytes: int, everyone: list[Introduction], touchable: int | None = None) -> None:
    """Raise SharedMemorySizeError unless every rank's `touchable` bytes (default: the whole segment)
    fit the least room any rank sees: in /dev/shm, under the memory cgroup's limit, and in the host's
    available memory. A segment maps `segment_bytes`, but a tmpfs page is taken only once touched,
    so the check counts the most the calls can touch (`ubep.transport.heap.Layout.touchable`;
    docs/reliability.md, "Footprint").

    Every rank sees the same introductions, so every rank raises, or none does."""
    touchable = segment_bytes if touchable is None else touchable
    needed = touchable * len(everyone)
    free, where = min(i.shm_free for i in everyone), f"{SHM_DIR} has"
    for limit, said in (
        ([i.cgroup_free for i in everyone], "the memory cgroup's limit leaves"),
        ([i.memory_free for i in everyone], "the host's available memory (MemAvailable + SwapFree) is"),
    ):
        known = [v for v in limit if v is not None]
        if known and min(known) < free:
            free, where = min(known), said
    if needed > free:
        raise SharedMemorySizeError(
            f"Buffer construction: the shared segments need {needed} bytes ({_mib(needed)}) on this host "
            f"({len(everyone)} ranks x {touchable} bytes that calls can touch, of the {segment_bytes} "
            f"bytes each rank maps), but {where} {free} bytes ({_mib(free)}) free; {KNOBS}",
            needed,
            free,
        )


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


# -- creating and mapping ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Mapped:
    """One segment mapped here, and its file kept open: after every name is unlinked, the open file is
    how a process that restarts in a dead rank's place reaches the segments (`attach_from`)."""

    map: mmap.mmap
    fd: int

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:
            pass  # a tensor view still exists; the mapping goes when it does
        try:
            os.close(self.fd)
        except OSError:
            pass


def _create(name: str, nbytes: int) -> Mapped:
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, max(nbytes, 1))
        return Mapped(mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED), fd)
    except BaseException:
        os.close(fd)
        raise


def _attach(name: str, nbytes: int) -> Mapped:
    return _map_checked(os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW), name, nbytes)


def _map_checked(fd: int, name: str, nbytes: int) -> Mapped:
    """Map the open segment file `fd` (ours, mode 0600, at least `nbytes`); keeps `fd` open."""
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
            raise PermissionError(f"shared segment {name} has an unexpected owner or mode")
        if info.st_size < nbytes:
            raise ValueError(f"shared segment {name} is {info.st_size} bytes, expected {nbytes}")
        return Mapped(mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED), fd)
    except BaseException:
        os.close(fd)
        raise


def _unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def _gather(group: dist.ProcessGroup, world_size: int, mine):
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def _raise_failures(phase: str, failures: list[str | None], rank: int) -> None:
    """Every rank raises if any failed: the first failing rank is named (this rank's own error
    is raised by the caller)."""
    failed = [r for r, f in enumerate(failures) if f is not None and r != rank]
    if failed:
        raise PeerAbortedError(phase, failed[0], AbortNotice(failures[failed[0]]))


def _try(action) -> tuple[object, BaseException | None]:
    """(result, None), or (None, the exception) for an ordinary failure."""
    try:
        return action(), None
    except Exception as error:  # raised after the peers learn of it
        return None, error


def _described(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"


class SymmetricHeap:
    """Every rank's segment, mapped here; built collectively over `group` (see the module doc).

    `touchable`: the most bytes of a segment its users can touch (default: all), what the room
    check counts (`check_room`).

    `names` are every rank's segment name (unlinked once built); `doorbell_key` is a
    secret every rank of the job shares and nobody else can learn, for `ubep.doorbell`;
    `creators` say who each rank is (`creators[r].is_gone()`: rank r provably exited,
    correct across PID namespaces, where a bare pid is not).
    """

    def __init__(
        self,
        layout: SegmentLayout,
        group: dist.ProcessGroup,
        rank: int,
        world_size: int,
        touchable: int | None = None,
    ):
        self.layout = layout
        self.rank = rank
        self.world_size = world_size
        self._maps: list[Mapped] = []
        sweep_stale_segments()
        everyone: list[Introduction] = _gather(group, world_size, Introduction.here())
        check_room(layout.nbytes, everyone, touchable)
        self.creators = [i.creator for i in everyone]
        key = hashlib.sha256("".join(i.token for i in everyone).encode()).digest()
        self.names = [_name(i.creator, _token(key, f"segment {r}")) for r, i in enumerate(everyone)]
        self.doorbell_key = hmac.digest(key, b"doorbell", "sha256")
        try:
            self._maps = self._build(group)
        except BaseException:
            self.close()
            for name in self.names:  # the job's names, a killed rank's among them
                _unlink(name)
            raise  # a peer's death is named by the Buffer's construction deadline (`ubep.deadlines`)
        self._views_of_maps()

    @classmethod
    def attach_from(
        cls, layout: SegmentLayout, rank: int, names: list[str], holder: Creator, fds: list[int]
    ) -> SymmetricHeap:
        """Map every rank's segment through the files a live rank (`holder`, with segment `fds[r]` of
        rank r open) keeps open, for a process restarting as `rank` in a running job: it takes rank
        `rank`'s segment over, emptied (its pages punched out: everyone reads zeros, nothing the dead
        process left). Needs the holder in this PID namespace under this user (`/proc/PID/fd`)."""
        heap = cls.__new__(cls)
        heap.layout, heap.rank, heap.world_size, heap._maps = layout, rank, len(names), []
        heap.names, heap.creators, heap.doorbell_key = list(names), [], b""  # the key: from the heap
        if holder.pid_ns != pid_namespace() or holder.is_gone():
            raise PermissionError(
                f"rank holding the segments (pid {holder.pid}) is gone or in another PID namespace"
            )
        try:
            for name, fd in zip(names, fds, strict=True):
                opened = os.open(f"/proc/{holder.pid}/fd/{fd}", os.O_RDWR)
                heap._maps.append(_map_checked(opened, name, layout.nbytes))
        except BaseException:
            heap.close()
            raise
        heap._maps[rank].map.madvise(mmap.MADV_REMOVE)  # the dead process's bytes: zeros for everyone
        heap._views_of_maps()
        return heap

    @property
    def fds(self) -> list[int]:
        """The open file of every rank's segment here, rank-indexed (`attach_from`)."""
        return [m.fd for m in self._maps]

    def _views_of_maps(self) -> None:
        self._words = [np.frombuffer(m.map, dtype=np.int64) for m in self._maps]
        self._bytes = [torch.frombuffer(m.map, dtype=torch.uint8) for m in self._maps]
        self._views: dict[tuple[int, str], torch.Tensor] = {}
        self._word_views: dict[tuple[int, str], np.ndarray] = {}

    def _build(self, group: dist.ProcessGroup) -> list[Mapped]:
        """Create this rank's segment, map everyone's, unlink every name; each step's failure
        anywhere raises everywhere."""
        nbytes = self.layout.nbytes
        own, error = _try(lambda: _create(self.names[self.rank], nbytes))
        if own is not None:
            self._maps = [own]  # closed by the caller if a later step fails
        if isinstance(error, OSError) and error.errno in (errno.ENOMEM, errno.ENOSPC, errno.EFBIG):
            error = SharedMemorySizeError(
                f"Buffer construction: rank {self.rank} could not create its {nbytes}-byte "
                f"({_mib(nbytes)}) shared segment ({error.strerror}); {KNOBS}",
                nbytes,
                0,
            )
        failures = _gather(group, self.world_size, _described(error))
        if error is not None:
            raise error
        _raise_failures("Buffer construction (creating segments)", failures, self.rank)
        maps: list[Mapped] = [own] * self.world_size
        for r, name in enumerate(self.names):
            if r != self.rank and error is None:
                maps[r], error = _try(lambda name=name: _attach(name, nbytes))
                if error is None:
                    self._maps.append(maps[r])
        failures = _gather(group, self.world_size, _described(error))  # everyone has mapped (or failed)
        for name in self.names:
            _unlink(name)
        if error is not None:
            raise error
        _raise_failures("Buffer construction (mapping segments)", failures, self.rank)
        return maps

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
            m.close()


def _token(key: bytes, purpose: str) -> str:
    """96 bits derived from the job's secret: unguessable without it, the same on every rank."""
    return hmac.digest(key, purpose.encode(), "sha256")[:12].hex()

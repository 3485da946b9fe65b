"""The EP group as ubep sees it: ranks, which node each lives on, and the choice
of transport, with the reason for it.

Node membership follows torchrun: `GROUP_RANK` (the node's index) when set,
else the host name. This is the one place that reads the environment.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import platform
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ubep.deadlines import PeerPids, collective_deadline, here
from ubep.errors import CommTimeoutError, ConfigMismatchError
from ubep.nodes import NodeMap
from ubep.registry import AUTO, CUDA, DIST, HIER, LOCAL, SHM, TIERS, TRANSPORTS, VIRTUAL, one_of
from ubep.transport.shm import Rejoining, job_store
from ubep.transport.virtual import VirtualRank

SHM_ARCHES = ("x86_64", "amd64")


@dataclass(frozen=True, slots=True)
class GroupInfo:
    group: dist.ProcessGroup | VirtualRank | Rejoining | None
    rank: int
    world_size: int
    node_of_rank: tuple[int, ...]  # node index of each rank, numbered by first appearance
    peers: PeerPids | None = None  # each rank's process where it shares this host (liveness checks)

    @property
    def num_nodes(self) -> int:
        return len(set(self.node_of_rank))


def join_group(group: dist.ProcessGroup | VirtualRank | Rejoining | None) -> GroupInfo:
    """Resolve `group`; under torchrun with no group initialised yet, join torchrun's.

    A `VirtualRank` is one rank of a virtual world: all its ranks share this process and host. A
    `Rejoining` process joins a running job of this host through its store, with no collective.
    """
    if isinstance(group, VirtualRank | Rejoining):
        return GroupInfo(group, group.rank, group.world_size, (0,) * group.world_size)
    if group is None and not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            dist.init_process_group("gloo")
            atexit.unregister(leave_group)  # once, however many Buffers joined
            atexit.register(leave_group)
        else:
            return GroupInfo(None, 0, 1, (0,))
    group = group or dist.group.WORLD
    atexit.unregister(collect_leftovers)  # once, however many Buffers joined
    atexit.register(collect_leftovers)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    everyone: list[tuple[str, tuple] | None] = [None] * world
    dist.all_gather_object(everyone, (node_key(), here()), group=group)
    keys = [key for key, _ in everyone]
    order = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    peers = PeerPids.of(rank, [process for _, process in everyone])
    return GroupInfo(group, rank, world, tuple(order[k] for k in keys), peers)


def collect_leftovers() -> None:
    """At exit, free closed Buffers' leftovers held only by reference cycles (see `leave_group`)."""
    gc.collect()


def leave_group() -> None:
    """At exit, destroy the group `join_group` initialised, unless the program did already.

    A gloo group left to the interpreter's teardown can end the process with "terminate
    called without an active exception" after every result is in (its threads are destroyed
    unjoined; upstream: pytorch/pytorch#190489), so torchrun reports the job FAILED. A program
    that let ubep join torchrun's group never initialised one, so it would not destroy it.
    Whichever group a Buffer joined, `collect_leftovers` runs at exit too, so that no
    closed Buffer's leftovers in a reference cycle keep a destroyed group alive until teardown.
    """
    collect_leftovers()  # their references to the group go first
    if dist.is_initialized():
        dist.destroy_process_group()


def all_gather_object(info: GroupInfo, obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (collective over the group, whichever kind it is)."""
    if isinstance(info.group, Rejoining):
        raise RuntimeError(
            f"rank {info.rank} rejoined its group through the rendezvous store and holds no process group: "
            "it cannot take part in a torch.distributed collective (stats(merge=True), set_placement)"
        )
    if isinstance(info.group, VirtualRank):
        return info.group.world.all_gather(info.rank, obj)
    everyone: list[Any] = [None] * info.world_size
    dist.all_gather_object(everyone, obj, group=info.group)
    return everyone


def group_among(info: GroupInfo, ranks: tuple[int, ...], timeout_s: float) -> dist.ProcessGroup | None:
    """A torch.distributed group of `ranks` (ascending; this rank among them) alone, built by them
    alone (the group's other ranks, dead or gone, need not come), for `all_gather_among`: the
    group's own connections to a rank that died are broken, and a collective over them fails.
    None for a virtual rank, whose world gathers among any ranks. Collective among `ranks`."""
    if isinstance(info.group, VirtualRank):
        return None
    group = torch_group(info.group)
    members = [dist.get_global_rank(group, r) for r in ranks] if group is not None else list(ranks)
    return dist.new_group(
        members,
        timeout=timedelta(seconds=timeout_s),
        backend=dist.get_backend(group),
        use_local_synchronization=True,
    )


def all_gather_among(
    info: GroupInfo,
    ranks: tuple[int, ...],
    among: dist.ProcessGroup | None,
    mine: torch.Tensor,
    timeout_s: float,
    phase: str,
    watch: bool = False,
) -> torch.Tensor:
    """[R, *mine.shape]: `mine` of each of `ranks` (ascending, this rank among them), zeros in the
    rows of the group's other ranks: a collective among `ranks` alone, so ranks masked out of a
    Buffer (dead, or gone) need not come. Every one of `ranks` passes a tensor of the same shape
    and dtype. `among`: `group_among(info, ranks)` where `ranks` is not the whole group. Under
    `timeout_s` seconds; a peer that does not come is named (CommTimeoutError, in `phase`).
    `watch`: raise as soon as a peer of this host among `ranks` has exited, on every rank alike
    (a ring's rank that is no neighbour of the dead one would otherwise wait out the deadline)."""
    if info.rank not in ranks:
        raise ValueError(f"rank {info.rank} gathers among {list(ranks)}, which leave it out")
    everyone = [torch.zeros_like(mine) for _ in range(info.world_size)]
    everyone[info.rank] = mine
    if isinstance(info.group, VirtualRank):
        for r, theirs in info.group.world.all_gather_among(info.rank, ranks, mine, phase).items():
            everyone[r] = theirs
        return torch.stack(everyone)
    whole = len(ranks) == info.world_size
    group = torch_group(info.group) if whole else among
    parts = everyone if whole else [torch.zeros_like(mine) for _ in ranks]
    peers = info.peers if whole else None  # (the pids are by the whole group's ranks: `names` says)
    with collective_deadline(group, timeout_s, phase, peers, None if whole else ranks):
        work = dist.all_gather(parts, mine, group=group, async_op=True)
        if watch and info.peers is not None:
            _wait_watching(work, info.peers, ranks, time.monotonic() + timeout_s, timeout_s, phase)
        work.wait()
    if not whole:
        for r, theirs in zip(ranks, parts, strict=True):
            everyone[r] = theirs
    return torch.stack(everyone)


WATCH_PAUSE_S = 0.02  # the longest pause between looks at a pending gather and its peers' processes


def _wait_watching(work, peers: PeerPids, ranks, deadline: float, timeout_s: float, phase: str) -> None:
    """Until `work` completes or the deadline passes: raise CommTimeoutError naming the peers among
    `ranks` whose process exited. Pauses grow from 1 ms to WATCH_PAUSE_S, yielding the CPU."""
    pause = 0.001
    while not work.is_completed() and time.monotonic() < deadline:
        dead = [r for r in peers.dead() if r in ranks]
        if dead:
            raise CommTimeoutError(phase, dead, timeout_s, dead, "its process exited during the gather")
        time.sleep(pause)
        pause = min(2 * pause, WATCH_PAUSE_S)


def check_agreement(info: GroupInfo, mine: dict[str, Any], what: str) -> None:
    """Collective: raise ConfigMismatchError on every rank unless all ranks passed equal `mine`.

    The error names each disagreeing field and which ranks hold which value.
    """
    if info.world_size == 1:
        return
    if isinstance(info.group, Rejoining):
        everyone = [mine, _agreed(info, what)]
    else:
        everyone = all_gather_object(info, mine)
    disagreements = []
    for field in mine:
        values = [cfg.get(field) for cfg in everyone]
        if any(v != values[0] for v in values):
            groups: dict[str, list[int]] = {}
            for rank, value in enumerate(values):
                groups.setdefault(repr(value)[:60], []).append(rank)
            detail = "; ".join(
                f"rank(s) {', '.join(map(str, ranks))}: {value}" for value, ranks in groups.items()
            )
            disagreements.append(f"{field} ({detail})")
    if disagreements:
        raise ConfigMismatchError(
            f"{what} on rank {info.rank}: ranks disagree on " + ", and on ".join(disagreements)
        )


def agreed_key(world_size: int, what: str) -> str:
    """Where the running job keeps what its ranks agreed on for `what` (the rendezvous store)."""
    return f"ubep/rejoin/{world_size}/{what}"


def keep_agreed(info: GroupInfo, mine: dict[str, Any], what: str) -> None:
    """After an agreement on a real group: rank 0 keeps it in the job's store, for a process that
    rejoins later (`Rejoining`) to check its own against. Nothing without a store."""
    store = job_store() if info.rank == 0 and isinstance(info.group, dist.ProcessGroup | None) else None
    if store is not None:
        store.set(agreed_key(info.world_size, what), json.dumps(mine))


def _agreed(info: GroupInfo, what: str) -> dict[str, Any]:
    store, key = info.group.store, agreed_key(info.world_size, what)
    if not store.check([key]):
        raise ConfigMismatchError(f"{what} on rank {info.rank} (rejoining): the job's store holds no {what}")
    return json.loads(store.get(key))


def node_key() -> str:
    """What identifies this process's node: torchrun's GROUP_RANK, else the host name."""
    group_rank = os.environ.get("GROUP_RANK")
    return f"node-{group_rank}" if group_rank is not None else f"host-{socket.gethostname()}"


def shm_supported() -> tuple[bool, str]:
    """Whether the shared-memory transport's memory-ordering argument holds here."""
    if not os.path.isdir("/dev/shm"):
        return False, "no /dev/shm on this host"
    arch = platform.machine().lower()
    if arch not in SHM_ARCHES:
        return False, f"{arch} is not x86-64: its weakly ordered stores need fences Python cannot issue"
    return True, "x86-64 keeps stores in order (TSO)"


def cuda_supported(info: GroupInfo) -> tuple[bool, str]:
    """Whether the CUDA heap can carry this group: CUDA available, an NCCL group (its tensors live on
    GPUs, one a rank), every rank on one host (torch symmetric memory maps peers within a host)."""
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    if not dist.is_initialized():
        return False, "torch.distributed is not initialized"
    backend = dist.get_backend(info.group if info.group is not None else dist.group.WORLD)
    if backend != "nccl":
        return False, f"the group's backend is {backend!r}, not 'nccl': its tensors live on the CPU"
    if info.num_nodes > 1:
        return False, f"the group spans {info.num_nodes} nodes; symmetric memory maps GPUs of one host"
    return True, "an NCCL group on one host: CUDA tensors, each GPU maps its peers' (torch symmetric memory)"


def hier_supported(info: GroupInfo) -> tuple[bool, str]:
    """Whether the hierarchical exchange can run: equal nodes, the whole world, shared memory."""
    ok, why = NodeMap(info.node_of_rank).uniform()
    if not ok:
        return False, why
    if dist.is_initialized() and dist.get_world_size() != info.world_size:
        return False, "the EP group is a subgroup, and its rail and node groups are made from the whole world"
    shm_ok, shm_why = shm_supported()
    if not shm_ok:
        return False, f"shared memory unavailable ({shm_why})"
    return True, f"{why}: shared memory within a node, one crossing per token and node between them"


def choose_transport(requested: str, info: GroupInfo) -> tuple[str, str]:
    """(transport, reason): 'local' for one rank, 'shm' within a host, across hosts 'hier' where a host
    holds several ranks (a token then crosses to a host once, however many of its ranks it goes to)
    and 'dist' (every peer directly) with one rank per host, where neither fits, or when asked for
    (the names of `ubep.registry`)."""
    one_of("transport", TRANSPORTS, requested)
    if info.world_size == 1:
        return LOCAL.name, LOCAL.summary
    if isinstance(info.group, Rejoining):
        if requested not in (AUTO, SHM.name):
            raise ValueError(f"a rank rejoins a running group on transport {SHM.name!r}, not {requested!r}")
        return SHM.name, f"rejoining a running {info.world_size}-rank job on this host's shared segments"
    if isinstance(info.group, VirtualRank):
        if requested not in (AUTO, VIRTUAL.name):
            raise ValueError(f"a virtual rank's group runs transport {VIRTUAL.name!r}, not {requested!r}")
        return VIRTUAL.name, f"{info.world_size} virtual ranks share this process's memory"
    if requested == VIRTUAL.name:
        raise ValueError("transport='virtual' needs a VirtualRank as the group (see ubep.transport.virtual)")
    if requested == CUDA.name or (requested == AUTO and info.num_nodes == 1):
        cuda_ok, cuda_why = cuda_supported(info)
        if cuda_ok:
            return CUDA.name, cuda_why
        if requested == CUDA.name:
            raise ValueError(f"transport='cuda' is not available: {cuda_why}")
    ok, why = shm_supported()
    if requested == DIST.name:
        return DIST.name, "requested: torch.distributed collectives"
    if requested == AUTO and info.num_nodes > 1 and info.num_nodes == info.world_size:
        return DIST.name, (
            f"one rank on each of {info.num_nodes} hosts: no token has two destinations on one host, so "
            "hier's one crossing per host saves nothing; every peer directly sends fewer bytes"
        )
    if requested == TIERS.name:
        tiers_ok, tiers_why = hier_supported(info)
        if not tiers_ok:
            raise ValueError(f"transport='tiers' is not available: {tiers_why}")
        return TIERS.name, f"requested: {tiers_why}, one crossing per token and rack between racks"
    if requested == HIER.name or (requested == AUTO and info.num_nodes > 1):
        hier_ok, hier_why = hier_supported(info)
        if hier_ok:
            return HIER.name, hier_why
        if requested == HIER.name:
            raise ValueError(f"transport='hier' is not available: {hier_why}")
        return DIST.name, f"the group spans {info.num_nodes} nodes and hier is unavailable ({hier_why})"
    if info.num_nodes > 1:
        if requested == SHM.name:
            raise ValueError(f"transport='shm' needs one host; the group spans {info.num_nodes} nodes")
        return DIST.name, f"the group spans {info.num_nodes} nodes: torch.distributed carries the traffic"
    if not ok:
        if requested == SHM.name:
            raise ValueError(f"transport='shm' is not available: {why}")
        return DIST.name, f"shared memory unavailable ({why})"
    return SHM.name, f"all {info.world_size} ranks share this host and {why}"


def torch_group(group) -> dist.ProcessGroup | None:
    """The torch.distributed group a Buffer's construction will use, where it exists already (for
    its deadline); None for a virtual rank or where torch.distributed is not initialised."""
    if isinstance(group, VirtualRank | Rejoining):
        return None
    if group is not None or not dist.is_initialized():
        return group
    return dist.group.WORLD

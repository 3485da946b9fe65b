"""One registry of names: every protocol, transport, engine and fabric says here, once, what it is
called and what it can do.

    Buffer(protocol=, transport=, engine=, fabric=)  ->  [registry: name -> spec]  ->  factory, settings,
                                                                                       sizing, warm-up,
                                                                                       explain(), CLI

The rest of the library asks a spec (`TRANSPORTS[name].crosses_hosts`, `ENGINES[name].compiled`)
or compares with a spec's `name`; no other module spells a protocol, transport, engine or fabric
name as a string (tests/tools/test_registry.py holds that rule). What each one is built from
stays with the layer that builds it (`ubep.factory`, `ubep.engine`, `ubep.across.fabric`): this
module imports nothing of ubep, so every layer may read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

AUTO = "auto"  # every option's "choose for me"


@dataclass(frozen=True, kw_only=True, slots=True)
class ProtocolSpec:
    """A normal-mode protocol: the order of work and synchronisation of dispatch and combine."""

    name: str
    summary: str
    # headers its Triton halves stamp and poll in device memory (`ubep.protocols.<name>.blocks`)
    device_headers: tuple[str, ...]
    # across hosts its messages go over a fabric, with no collective inside a call (`ubep.across`);
    # else it runs on torch.distributed's collectives there (`ubep.across.collectives`)
    over_fabric: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class TransportSpec:
    """Where a Buffer's rows travel: a heap of one-sided memory inside a host, or a strategy across
    hosts (`ubep.across`), or nothing at all (a group of one)."""

    name: str
    summary: str
    heap: bool = False  # one-sided memory every rank maps (the protocols of `ubep.protocols` run on it)
    crosses_hosts: bool = False  # a strategy of `ubep.across`
    hierarchical: bool = False  # crosses once per token and host, then fans out over a heap inside it
    racked: bool = False  # hierarchical, and before the hosts crosses once per token and rack (`racks`)
    on_device: bool = False  # the Buffer's tensors live on the GPU
    maskable: bool = False  # `Buffer.mask_ranks` can leave a rank out
    choosable: bool = True  # may be asked for by name (a group of one gets its transport by itself)


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineSpec:
    """The kernels that move and reduce rows (`ubep.engine`)."""

    name: str
    summary: str
    compiled: bool = False  # numba: each call half on a heap runs as one compiled function
    device_kernels: bool = False  # Triton: each call half runs as one kernel, on the device
    extra: str | None = None  # the pip extra it needs


@dataclass(frozen=True, kw_only=True, slots=True)
class FabricSpec:
    """How bytes reach a rank on another host (`ubep.across.fabric`)."""

    name: str
    summary: str
    extra: str | None = None


UBEP = ProtocolSpec(
    name="ubep",
    summary="asynchronous, data as flag: no barrier, each source used as it lands",
    device_headers=("ubep.route", "ubep.data", "ubep.back"),
    over_fabric=True,
)
BSP = ProtocolSpec(
    name="bsp",
    summary="the barrier-phased baseline that vendor libraries and Megatron use",
    device_headers=("bsp.counts", "bsp.staged", "bsp.back"),
)
PROTOCOLS: Mapping[str, ProtocolSpec] = {p.name: p for p in (UBEP, BSP)}

LOCAL = TransportSpec(name="local", summary="a group of one rank needs no transport", choosable=False)
SHM = TransportSpec(
    name="shm", summary="POSIX shared memory among the ranks of a host", heap=True, maskable=True
)
VIRTUAL = TransportSpec(
    name="virtual", summary="ranks as threads of one process, for tests", heap=True, maskable=True
)
CUDA = TransportSpec(
    name="cuda", summary="an NCCL group's GPUs on one host, torch symmetric memory", heap=True, on_device=True
)
HIER = TransportSpec(
    name="hier",
    summary="across hosts: a token crosses once per remote host, then fans out over shared memory",
    crosses_hosts=True,
    hierarchical=True,
)
TIERS = TransportSpec(
    name="tiers",
    summary="across racks of hosts: a token crosses the slow tier once per remote rack, the fast tier once "
    "per remote host of that rack, then fans out over shared memory",
    crosses_hosts=True,
    hierarchical=True,
    racked=True,
)
DIST = TransportSpec(
    name="dist",
    summary="across hosts: every peer reached directly over torch.distributed",
    crosses_hosts=True,
)
TRANSPORTS: Mapping[str, TransportSpec] = {t.name: t for t in (LOCAL, SHM, CUDA, DIST, HIER, TIERS, VIRTUAL)}

TORCH = EngineSpec(name="torch", summary="portable torch kernels, the readable statement")
NUMBA = EngineSpec(name="numba", summary="compiled CPU kernels and call halves", compiled=True, extra="fast")
TRITON = EngineSpec(
    name="triton",
    summary="CUDA kernels and call halves (CPU: TRITON_INTERPRET=1)",
    device_kernels=True,
    extra="device",
)
ENGINES: Mapping[str, EngineSpec] = {e.name: e for e in (TORCH, NUMBA, TRITON)}

GLOO = FabricSpec(name="gloo", summary="torch.distributed point-to-point over TCP, no extra dependency")
NIXL = FabricSpec(name="nixl", summary="NIXL one-sided writes over UCX: TCP, InfiniBand, EFA", extra="nixl")
ZMQ = FabricSpec(
    name="zmq", summary="ZeroMQ over TCP, every wait blocked on all peers at once (pyzmq)", extra="zmq"
)
FABRICS: Mapping[str, FabricSpec] = {f.name: f for f in (GLOO, ZMQ, NIXL)}


def choices(table: Mapping[str, object], auto: bool = True) -> tuple[str, ...]:
    """The names a caller may pass for one option: "auto" (where it has one), then each choosable name."""
    names = tuple(name for name, spec in table.items() if getattr(spec, "choosable", True))
    return ((AUTO,) if auto else ()) + names


def one_of(option: str, table: Mapping[str, object], value: str, auto: bool = True) -> str:
    """`value`, where it names an entry of `table` (or "auto"); else ValueError naming the choices."""
    allowed = choices(table, auto)
    if value not in allowed:
        raise ValueError(f"{option} must be one of {allowed}, got {value!r}")
    return value

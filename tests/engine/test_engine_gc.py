"""Loading the numba engine from a warm cache runs next to no garbage-collection pass: in a process
that imported torch each pass walks torch's objects too, and passes took a third of the CPU time of
loading the kernels, which a restarted rank pays before it can ask to rejoin (docs/reliability.md,
"A restarted rank rejoins"). The reference is the same load, in a fresh process, with the pause taken
out; every process leaves the collector as it found it.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest

import ubep.engine

pytest.importorskip("numba")

LOAD = """
import contextlib, gc, json, sys
import torch, ubep, ubep.engine
from ubep.factory import ready_engine

if sys.argv[1] == "unpaused":
    ubep.engine.collections_paused = contextlib.nullcontext  # before the engine's modules import it
passes = []
gc.callbacks.append(lambda phase, info: passes.append(info["generation"]) if phase == "start" else None)
engine, _ = ready_engine("numba")
print(json.dumps({"passes": len(passes), "enabled": gc.isenabled(), "kernels": engine.kernels_origin()}))
"""


def load(mode: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", LOAD, mode], capture_output=True, text=True, timeout=600, check=True
    )
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.timeout(1300)
def test_loading_the_numba_engine_pauses_the_collector():
    unpaused = load("unpaused")  # first: where the cache was cold, this one compiles
    paused = load("paused")
    assert "compiled" not in paused["kernels"], paused  # loaded from the cache: the pause covers loads
    assert paused["enabled"] and unpaused["enabled"]
    assert paused["passes"] * 4 <= unpaused["passes"], (paused, unpaused)


def test_a_pause_leaves_the_collector_as_it_found_it():
    with ubep.engine.collections_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with ubep.engine.collections_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()

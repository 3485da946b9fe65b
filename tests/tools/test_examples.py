"""The examples run as their docs say and compute what they claim."""

from __future__ import annotations

import os
import subprocess
import sys

import quickstart  # examples/ is on the path (conftest.py)
from repo import ROOT

import ubep


def test_quickstart_example():
    results = ubep.LocalLaunch(world_size=4, timeout_s=120).run(quickstart.moe_step)
    assert results == [(64, 0.0)] * 4


def test_placement_example_runs_as_a_script_and_keeps_the_outputs():
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "placement.py")],
        env=dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]),
        ),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == [f"rank {r}" for r in range(4)]
    diffs = [float(line.rsplit(" ", 1)[1]) for line in lines]
    assert max(diffs) < 1e-5  # the same layer before and after: only float32 sums regroup

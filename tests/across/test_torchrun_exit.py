"""torchrun jobs on the dist and hier transports exit cleanly (issue 23, item 13): the group ubep
joined for them is destroyed at exit, before gloo's teardown could end a rank with "terminate
called without an active exception". The suite runs one job per transport; the 20-run soak
is `UBEP_TORCHRUN_RUNS=20` (docs/reliability.md records it)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from repo import ROOT

SCRIPT = ROOT / "scripts" / "torchrun_exit.py"
RUNS = int(os.environ.get("UBEP_TORCHRUN_RUNS", "1"))


@pytest.mark.timeout(300 * RUNS)
@pytest.mark.parametrize("transport,nproc", [("dist", 2), ("hier", 4)])
def test_torchrun_job_exits_clean(transport, nproc):
    cmd = [sys.executable, str(SCRIPT), "--runs", str(RUNS), "--nproc", str(nproc), "--transport", transport]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=280 * RUNS)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]

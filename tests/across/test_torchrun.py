"""Under torchrun, a Buffer joins the launched group on its own, on one node and on two."""

from __future__ import annotations

import os
import subprocess
import sys

from repo import SUPPORT


def torchrun_agent(*args: str) -> subprocess.Popen:
    """One torchrun agent running tests/support/torchrun_job.py (each agent is one node)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", *args, str(SUPPORT / "torchrun_job.py")]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_joins_torchrun_group_on_one_node():
    agent = torchrun_agent("--standalone", "--nproc-per-node=2")
    out, err = agent.communicate(timeout=180)
    assert agent.returncode == 0, err[-3000:]
    assert out.count("ok=True") == 2 and "transport shm" in out


def test_two_torchrun_nodes_of_one_rank_take_the_flat_path():
    # Two torchrun agents on this host emulate two nodes (--nnodes=2): GROUP_RANK differs. With one
    # rank per node no token shares a crossing, so "auto" goes flat (hier takes two ranks a node).
    port = 29400 + os.getpid() % 1000
    rdzv = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
    agents = [torchrun_agent(*rdzv, "--rdzv-id=ubep-test") for _ in range(2)]
    outs = [a.communicate(timeout=180) for a in agents]
    assert all(a.returncode == 0 for a in agents), "\n".join(err[-2000:] for _, err in outs)
    text = "".join(out for out, _ in outs)
    assert text.count("ok=True") == 2 and "transport dist (one rank on each of 2 hosts" in text

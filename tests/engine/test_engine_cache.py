"""A corrupt numba disk cache is found while the engine is chosen, never inside a call.

numba loads a kernel's compiled code from its cache directory on the kernel's
first call in a process; a damaged file (a full disk, an interrupted write)
raises there (UnpicklingError). Each case fills a fresh cache directory in one
process, damages every cached file of one kernel, then, in another process,
checks that `engine="auto"` falls back to torch with the reason in `explain()`
and that the call is exact against `ubep.reference`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")

CALL = """
import json, torch, ubep
from ubep import reference
from ubep.transport.virtual import VirtualWorld

R, E, N, H = 2, 4, 5, 8
xs = [torch.randn(N, H, generator=torch.Generator().manual_seed(r)) for r in range(R)]
idx = [torch.randint(0, E, (N, 1), generator=torch.Generator().manual_seed(10 + r)) for r in range(R)]
ws = [torch.rand(N, 1, generator=torch.Generator().manual_seed(20 + r)) for r in range(R)]

def step(rank):
    r = rank.rank
    # workers > 1 runs the protocol step by step, through the several-source block kernels
    with ubep.Buffer(hidden=H, num_experts=E, max_tokens_per_rank=N, group=rank, workers=2) as buf:
        recv_x, _, _, _, handle, _ = buf.dispatch(xs[r], topk_idx=idx[r], topk_weights=ws[r])
        combined = buf.combine(recv_x * 2, handle)[0]
        return buf.explain(), recv_x, combined

got = VirtualWorld(R, timeout_s=300).run(step)
ref = reference.dispatch(xs, idx, ws, E)
back = reference.combine([d.recv_x_MH * 2 for d in ref], ref, [N] * R)
exact = all(torch.equal(got[r][1], ref[r].recv_x_MH) and torch.equal(got[r][2], back[r]) for r in range(R))
print(json.dumps({"explain": got[0][0], "exact": exact}))
"""


def _python(code: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=400)


@pytest.fixture(scope="module")
def filled_cache(tmp_path_factory) -> Path:
    """A cache directory holding every kernel of the call, compiled once for the module."""
    cache = tmp_path_factory.mktemp("numba_cache")
    filled = _python(CALL, cache)
    assert filled.returncode == 0, filled.stderr[-3000:]
    assert "engine numba" in json.loads(filled.stdout.strip().splitlines()[-1])["explain"]
    return cache


@pytest.mark.parametrize("kernel", ["gather_blocks", "reduce_blocks"])
def test_a_corrupt_cached_kernel_falls_back_before_the_call(filled_cache, tmp_path, kernel):
    shutil.copytree(filled_cache, tmp_path, dirs_exist_ok=True)
    damaged = [f for f in tmp_path.rglob(f"numba_kernels.{kernel}-*") if f.suffix in (".nbi", ".nbc")]
    assert damaged, f"no cached file for {kernel} under the cache directory"
    for f in damaged:
        f.write_bytes(b"\x80not a pickle")
    ran = _python(CALL, tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    got = json.loads(ran.stdout.strip().splitlines()[-1])
    assert got["exact"]
    assert "engine torch" in got["explain"] and "numba kernels failed" in got["explain"], got["explain"]

"""A damaged numba disk cache is repaired while the engine is chosen, never met inside a call;
a sound one is read back once per host, and a Buffer built on it compiles nothing.

numba loads a kernel's compiled code from its cache directory on the kernel's
first call in a process; a damaged file (a full disk, an interrupted write)
raises there (UnpicklingError, ValueError). `ubep warm` fills a fresh cache
directory once for the module; each case damages files of one kernel in a copy,
then, in another process, checks that the file is named, removed and compiled
again: `engine="auto"` keeps numba (before issue 45, item 14: torch in every
process from then on), `engine="numba"` and `ubep warm` succeed (before: a raw
error naming no file), and the calls are exact against `ubep.reference`.

A Buffer on a warm cache (issue 42, item 8) reads the cache's files back once for the host (the
first process to find them changed since last read), skips the kernels' examples (run where
they compiled) and loads only what its halves use; a file gone from a checked cache is named
and compiled again while the Buffer is built, not inside its first call.
"""

from __future__ import annotations

import json
import os
import pickle
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


WARM_CALL = """
import json, torch, ubep
from ubep import reference
from ubep.engine.compile_once import kernel_stats
from ubep.transport.virtual import VirtualWorld

R, E, N, H = 2, 4, 5, 8
xs = [torch.randn(N, H, generator=torch.Generator().manual_seed(r)) for r in range(R)]
pick = [torch.Generator().manual_seed(10 + r) for r in range(R)]
idx = [torch.stack([torch.randperm(E, generator=pick[r])[:2] for _ in range(N)]) for r in range(R)]
ws = [torch.rand(N, 2, generator=torch.Generator().manual_seed(20 + r)) for r in range(R)]

def step(rank):
    r = rank.rank
    with ubep.Buffer(hidden=H, num_experts=E, max_tokens_per_rank=N, group=rank, engine="numba") as buf:
        built = kernel_stats()  # both ranks are built: construction ends in a collective handshake
        recv_x, _, _, _, handle, _ = buf.dispatch(xs[r], topk_idx=idx[r], topk_weights=ws[r])
        return built, recv_x, buf.combine(recv_x * 2, handle)[0]

got = VirtualWorld(R, timeout_s=300).run(step)
ref = reference.dispatch(xs, idx, ws, E)
back = reference.combine([d.recv_x_MH * 2 for d in ref], ref, [N] * R)
exact = all(torch.equal(got[r][1], ref[r].recv_x_MH) and torch.equal(got[r][2], back[r]) for r in range(R))
print(json.dumps({"built": got[0][0], "called": kernel_stats(), "exact": exact}))
"""


def _python(code: str, cache: Path, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), **env}
    env.pop("UBEP_LOG_LEVEL", None)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=400)


WARM = "from ubep.cli import main; raise SystemExit(main(['warm']))"


@pytest.fixture(scope="module")
def filled_cache(tmp_path_factory) -> Path:
    """A cache directory holding every kernel and call half, compiled once for the module."""
    cache = tmp_path_factory.mktemp("numba_cache")
    filled = _python(WARM, cache)
    assert filled.returncode == 0, filled.stderr[-3000:]
    return cache


def damage(cache: Path, kernel: str, suffixes: tuple[str, ...]) -> list[Path]:
    """Overwrite the cached files of `kernel` ("module.function") with bytes that are no pickle."""
    damaged = [f for f in cache.rglob(f"{kernel}-*") if f.suffix in suffixes]
    assert damaged, f"no cached file for {kernel} under the cache directory"
    for f in damaged:
        f.write_bytes(b"\x80not a pickle")
    return damaged


def readable_index(path: Path) -> bool:
    """numba's index format: a pickled version, then a pickled (stamp, overloads)."""
    with open(path, "rb") as f:
        pickle.load(f)
        _, overloads = pickle.loads(f.read())
    return bool(overloads)


@pytest.mark.parametrize("kernel", ["gather_blocks", "reduce_blocks"])
def test_a_corrupt_cached_kernel_is_repaired_before_the_call(filled_cache, tmp_path, kernel):
    shutil.copytree(filled_cache, tmp_path, dirs_exist_ok=True)
    damaged = damage(tmp_path, f"numba_kernels.{kernel}", (".nbi", ".nbc"))
    ran = _python(CALL, tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    got = json.loads(ran.stdout.strip().splitlines()[-1])
    assert got["exact"]
    assert "engine numba" in got["explain"], got["explain"]  # before: engine torch, in every process
    assert any(f"numba cache: {f} cannot be read" in ran.stderr for f in damaged), ran.stderr[-3000:]
    assert all(readable_index(f) for f in damaged if f.suffix == ".nbi")


def test_a_corrupt_index_is_named_and_repaired_by_ubep_warm_and_engine_numba(filled_cache, tmp_path):
    shutil.copytree(filled_cache, tmp_path, dirs_exist_ok=True)
    (index,) = damage(tmp_path, "numba_kernels.copy_rows", (".nbi",))
    warmed = _python(WARM, tmp_path)
    assert warmed.returncode == 0, warmed.stderr[-3000:]  # before: a traceback naming no file
    assert f"ubep warm: numba cache: {index} cannot be read" in warmed.stderr, warmed.stderr[-3000:]
    assert readable_index(index)
    damage(tmp_path, "numba_kernels.copy_rows", (".nbi",))
    ran = _python(CALL, tmp_path, UBEP_ENGINE="numba")  # before: UnpicklingError / ValueError raised
    assert ran.returncode == 0, ran.stderr[-3000:]
    got = json.loads(ran.stdout.strip().splitlines()[-1])
    assert got["exact"] and "engine numba" in got["explain"], got
    assert readable_index(index)


def compiled(stats: dict[str, list[int]]) -> dict[str, int]:
    """The functions `kernel_stats` says were compiled in the process, with how many signatures."""
    return {name: n for name, (n, _) in stats.items() if n}


def warm_build(cache: Path) -> tuple[subprocess.CompletedProcess, dict]:
    ran = _python(WARM_CALL, cache)
    assert ran.returncode == 0, ran.stderr[-3000:]
    return ran, json.loads(ran.stdout.strip().splitlines()[-1])


def test_a_warm_build_compiles_nothing_and_skips_the_examples(filled_cache, tmp_path):
    shutil.copytree(filled_cache, tmp_path, dirs_exist_ok=True)
    ran, got = warm_build(tmp_path)
    assert got["exact"]
    assert not compiled(got["called"]), (compiled(got["called"]), ran.stderr[-3000:])
    assert "cannot be read" not in ran.stderr and "is gone" not in ran.stderr, ran.stderr[-3000:]
    loaded = {name for name, (_, hits) in got["built"].items() if hits}
    assert any(".ubep.numba_halves." in name for name in loaded), loaded  # its halves, at construction
    assert "ubep.engine.numba_kernels.ll_owners" not in loaded, loaded  # examples only, not its halves


def test_a_file_gone_from_a_checked_cache_compiles_again_while_building(filled_cache, tmp_path):
    shutil.copytree(filled_cache, tmp_path, dirs_exist_ok=True)
    warm_build(tmp_path)  # checked: the listing of its files is recorded
    (gone,) = tmp_path.rglob("numba_halves.dispatch_gather-*.nbc")
    gone.unlink()
    ran, got = warm_build(tmp_path)
    assert got["exact"]
    assert f"numba cache: {gone} is gone" in ran.stderr, ran.stderr[-3000:]
    assert "ubep.protocols.ubep.numba_halves.dispatch_gather" in compiled(got["built"]), got["built"]
    assert compiled(got["called"]) == compiled(got["built"])  # nothing compiled inside a call
    assert gone.exists()

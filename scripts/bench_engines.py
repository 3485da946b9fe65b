"""Kernel micro-benchmark: the torch and numba engines side by side, one rank's share of one call.

    python scripts/bench_engines.py [--reps 21] [--tokens 128] [--no-compile]

The shape is `ubep bench`'s default as rank 0 sees it: 8 ranks x T tokens,
H 7168, top-8 of 256 experts (uniform routing), bf16 rows. Each kernel is
called the way the protocols call it (once per source rank, rows taken from
that source's region), on one thread (ranks outnumber cores). Times are the
calling thread's CPU time (`time.thread_time`), which a busy shared host
inflates far less than wall time; engines alternate within every repetition,
and the table gives medians. `--compile` (default on) also times the numba engine's
first use in fresh processes, with an empty and with a filled disk cache.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from ubep.engine import TorchEngine
from ubep.engine.numba_engine import NumbaEngine

R, H, K, E = 8, 7168, 8, 256
FIRST_USE = (
    "import time; t0 = time.perf_counter(); from ubep.engine.numba_engine import NumbaEngine; "
    "t1 = time.perf_counter(); NumbaEngine().warm_up(); t2 = time.perf_counter(); print(t1 - t0, t2 - t1)"
)


def workload(T: int, seed: int = 0) -> dict[str, Callable]:
    """Per kernel, a function(engine) that does rank 0's share of one call at this shape."""
    gen = torch.Generator().manual_seed(seed)
    topk_RTK = torch.rand(R, T, E, generator=gen).topk(K, dim=-1).indices  # distinct experts per token
    local_E = torch.where(torch.arange(E) // (E // R) == 0, torch.arange(E) % (E // R), -1)
    mine_R = [torch.nonzero((topk_RTK[r] // (E // R) == 0).any(1)).flatten() for r in range(R)]
    M = sum(m.numel() for m in mine_R)
    regions_RTH = torch.randn(R, T, H, generator=gen).bfloat16()  # each source's published rows
    weights_RTK = torch.rand(R, T, K, generator=gen)
    recv_MH = torch.empty(M, H, dtype=torch.bfloat16)
    recv_idx_MK, recv_w_MK = torch.empty(M, K, dtype=torch.int64), torch.empty(M, K)
    back_RTH = torch.randn(R, T, H, generator=gen).bfloat16()  # expert ranks' outputs for rank 0's tokens
    acc_TH, acc_TK = torch.zeros(T, H), torch.zeros(T, K)
    slots_XH = torch.randn(R * T, H, generator=gen).bfloat16()  # low-latency: returned rows, one per slot
    slot_TK = torch.randperm(R * T, generator=gen)[: T * K].view(T, K)
    y_TKH = torch.empty(T, K, H, dtype=torch.bfloat16)
    valid_TK = torch.rand(T, K, generator=gen) > 0.05
    offsets = [0, *torch.tensor([m.numel() for m in mine_R]).cumsum(0).tolist()]

    def per_source(step: Callable[[int, slice], None]) -> None:
        for r in range(R):
            step(r, slice(offsets[r], offsets[r + 1]))

    def gather(e):
        per_source(lambda r, s: e.copy_rows(regions_RTH[r], mine_R[r], recv_MH[s], None))

    def localize(e):
        def one(r, s):
            e.localize_rows(topk_RTK[r], weights_RTK[r], mine_R[r], local_E, recv_idx_MK[s], recv_w_MK[s])

        per_source(one)

    def reduce(e):
        acc_TH.zero_()
        per_source(lambda r, s: e.accumulate_rows(acc_TH, back_RTH[r, : mine_R[r].numel()], mine_R[r]))

    def reduce_weights(e):
        acc_TK.zero_()
        per_source(lambda r, s: e.accumulate_rows(acc_TK, recv_w_MK[s], mine_R[r]))

    def ll_gather(e):
        e.copy_rows(slots_XH, slot_TK.flatten(), y_TKH.view(-1, H), None)

    return {
        f"dispatch: gather {M} rows from {R} sources (copy_rows)": gather,
        f"dispatch: localize {M} rows' top-k (localize_rows)": localize,
        f"combine: accumulate {M} rows into {T} tokens (accumulate_rows)": reduce,
        f"combine: accumulate {M} weight rows (accumulate_rows, [n, {K}] fp32)": reduce_weights,
        f"low-latency: gather {T * K} slots (copy_rows)": ll_gather,
        f"low-latency: weighted_sum N={T} K={K}": lambda e: e.weighted_sum(y_TKH, weights_RTK[0], valid_TK),
        "finish: float32 acc -> bf16 (torch .to, either engine)": lambda e: acc_TH.to(torch.bfloat16),
    }  # fmt: skip


def median_ms(kernel: Callable, engines: dict, reps: int) -> dict[str, float]:
    """Median CPU time per engine, engines alternating in every repetition."""
    times: dict[str, list[float]] = {name: [] for name in engines}
    for e in engines.values():
        kernel(e)  # compile / warm caches
    for _ in range(reps):
        for name, e in engines.items():
            t0 = time.thread_time()
            kernel(e)
            times[name].append(time.thread_time() - t0)
    return {name: 1e3 * statistics.median(ts) for name, ts in times.items()}


def first_use_s(cache_dir: str) -> tuple[float, float]:
    """(import, warm_up) seconds of the numba engine in a fresh process using this cache directory."""
    env = {**os.environ, "NUMBA_CACHE_DIR": cache_dir}
    run = subprocess.run(
        [sys.executable, "-c", FIRST_USE], env=env, capture_output=True, text=True, check=True
    )
    imp, warm = run.stdout.split()
    return float(imp), float(warm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 8])
    parser.add_argument("--no-compile", action="store_true", help="skip the first-use timings")
    args = parser.parse_args()
    torch.set_num_threads(1)
    engines = {"torch": TorchEngine(), "numba": NumbaEngine()}
    print(f"median of {args.reps} runs, ms of CPU time, one thread; torch {torch.__version__}\n")
    for T in args.tokens:
        print(f"| {R} ranks x {T} tokens, H {H}, top-{K}, bf16 | torch | numba | torch / numba |")
        print("|---|---:|---:|---:|")
        for what, kernel in workload(T).items():
            ms = median_ms(kernel, engines, args.reps)
            print(f"| {what} | {ms['torch']:.3f} | {ms['numba']:.3f} | {ms['torch'] / ms['numba']:.2f}x |")
        print()
    if not args.no_compile:
        with tempfile.TemporaryDirectory() as cache_dir:
            cold = [first_use_s(tempfile.mkdtemp(dir=cache_dir)) for _ in range(2)]
            first_use_s(cache_dir)  # fill the cache
            warm = [first_use_s(cache_dir) for _ in range(3)]
        print("| numba engine, fresh process | import s | compile or load + check s |")
        print("|---|---:|---:|")
        for name, runs in (("empty disk cache (cold)", cold), ("filled disk cache (warm)", warm)):
            imp, warm_up = (statistics.median(x) for x in zip(*runs, strict=True))
            print(f"| {name}, median of {len(runs)} | {imp:.2f} | {warm_up:.2f} |")


if __name__ == "__main__":
    main()

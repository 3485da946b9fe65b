"""Buffer construction time per rank, with a cold and a warm numba cache (issue 36).

Each run is a fresh interpreter in which R ranks of `ubep.LocalLaunch` each time one
`ubep.Buffer` (hidden 256, 32 experts, 8 tokens, the defaults otherwise) and then one
dispatch + combine. Cold: an empty NUMBA_CACHE_DIR; warm: the directory the cold run
filled. The table gives, per case, the median over runs of the slowest rank's times.

    PYTHONPATH=src python scripts/construction_time.py --ranks 8,2 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
HIDDEN, EXPERTS, TOKENS = 256, 32, 8


def one_rank() -> tuple[float, float]:
    """(seconds to build the Buffer, seconds of the first dispatch + combine) on this rank."""
    import torch

    import ubep

    t0 = time.perf_counter()
    buf = ubep.Buffer(hidden=HIDDEN, num_experts=EXPERTS, max_tokens_per_rank=TOKENS)
    t1 = time.perf_counter()
    x = torch.ones(TOKENS, HIDDEN, dtype=torch.bfloat16, device="cpu")
    idx = torch.arange(TOKENS * 2, dtype=torch.int64, device="cpu").view(TOKENS, 2) % EXPERTS
    w = torch.full((TOKENS, 2), 0.5, dtype=torch.float32, device="cpu")
    got = buf.dispatch(x, topk_idx=idx, topk_weights=w)
    buf.combine(got.recv_x, got.handle)
    t2 = time.perf_counter()
    buf.close()
    return t1 - t0, t2 - t1


def child(ranks: int) -> None:
    """One run: every rank's times, as JSON on the last line of stdout."""
    import ubep

    print(json.dumps(ubep.LocalLaunch(world_size=ranks, timeout_s=900).run(one_rank)))


def run_once(ranks: int, cache: str) -> list[list[float]]:
    env = {**os.environ, "NUMBA_CACHE_DIR": cache}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, env.get("PYTHONPATH", "")) if p)
    code = f"import construction_time; construction_time.child({ranks})"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1200, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"{ranks} ranks failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--ranks", default="8,2", help="comma list of world sizes")
    parser.add_argument("--repeats", type=int, default=3, help="runs per case (each cold run a new cache)")
    parser.add_argument("--cold-repeats", type=int, help="cold runs per size (default: --repeats)")
    args = parser.parse_args()
    print("| ranks | cache | build, slowest rank (s) | build, median rank (s) | first call (s) | runs |")
    print("|---|---|---|---|---|---|")
    for R in (int(r) for r in args.ranks.split(",")):
        cold, warm = [], []
        with tempfile.TemporaryDirectory(prefix="ubep_numba_") as root:
            for i in range(args.cold_repeats or args.repeats):
                cache = os.path.join(root, f"cold{i}")
                cold.append(run_once(R, cache))
            warm = [run_once(R, cache) for _ in range(args.repeats)]
        for name, runs in (("cold", cold), ("warm", warm)):
            slowest = statistics.median(max(b for b, _ in run) for run in runs)
            median = statistics.median(statistics.median(b for b, _ in run) for run in runs)
            first = statistics.median(max(c for _, c in run) for run in runs)
            print(f"| {R} | {name} | {slowest:.2f} | {median:.2f} | {first:.2f} | {len(runs)} |", flush=True)


if __name__ == "__main__":
    main()

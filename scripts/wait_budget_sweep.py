"""Measure the compiled halves' wait budget: `ubep bench` (ubep beside the memcpy floor) under
several (spins, yields) budgets, in turns, at 8 and 128 tokens per rank.

The budget is a constant of `ubep.protocols.halves`, chosen once from these figures
(docs/benchmarks-log.md, "Waiting"). To try others without a setting a user would never need, each
run puts a `sitecustomize` on PYTHONPATH that sets the two constants in every rank process
before the bench starts. Budgets are run in turns (budget 1, 2, ..., then again), so a drift in
the host's load spreads over all of them.

    python scripts/wait_budget_sweep.py --ranks 8 --budgets 256/64,0/64,1024/64,256/0,256/512 --passes 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PATCH = """
import os
spins, yields = (int(v) for v in os.environ["UBEP_SWEEP_BUDGET"].split("/"))
import ubep.protocols.halves as halves
halves.SPIN_POLLS_SHARED = halves.SPIN_POLLS_ALONE = spins
halves.YIELD_POLLS = yields
with open(os.environ["UBEP_SWEEP_SEEN"], "a") as seen:  # the harness checks that the ranks' parent took it
    seen.write(f"{os.getpid()}\\n")
"""


def run_once(ranks: int, budget: str, tokens: str, patch_dir: str) -> dict[int, dict[str, float]]:
    """{tokens: {'ubep': dispatch + combine us, 'of_floor': floor / ubep}} of one bench."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out, tempfile.NamedTemporaryFile("r") as seen:
        env = dict(os.environ, UBEP_SWEEP_BUDGET=budget, UBEP_SWEEP_SEEN=seen.name)
        env["PYTHONPATH"] = patch_dir + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, "-m", "ubep", "bench", "--ranks", str(ranks), "--tokens", tokens,
               "--systems", "ubep,memcpy-floor", "--json", out.name]  # fmt: skip
        subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=600)
        if len(seen.read().split()) < 2:  # the bench and the fork server its ranks are forked from
            raise RuntimeError("the budget did not reach the rank processes (sitecustomize not run)")
        rows = json.loads(Path(out.name).read_text())["results"]
    return {
        row["tokens_per_rank"]: {
            "ubep": row["dispatch_us"] + row["combine_us"],
            "of_floor": row["floor_fraction"],
        }
        for row in rows
        if row["system"] == "ubep"
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument(
        "--budgets", default="256/64,0/64,1024/64,256/0,256/512", help="spins/yields, comma list"
    )
    parser.add_argument("--tokens", default="8,128")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--json", help="write every run's figures here")
    args = parser.parse_args()
    budgets = args.budgets.split(",")
    runs: dict[str, list] = {b: [] for b in budgets}
    with tempfile.TemporaryDirectory() as patch_dir:
        Path(patch_dir, "sitecustomize.py").write_text(PATCH)
        for p in range(args.passes):
            for b in budgets:
                runs[b].append(run_once(args.ranks, b, args.tokens, patch_dir))
                print(f"pass {p + 1}/{args.passes} budget {b}: done", file=sys.stderr, flush=True)
    tokens = [int(v) for v in args.tokens.split(",")]
    print(f"{args.ranks} ranks on {os.cpu_count()} cores; medians over {args.passes} runs")
    print("| spins/yields | " + " | ".join(f"{t} tok: d + c us, of floor" for t in tokens) + " |")
    print("|---|" + "---|" * len(tokens))
    for b in budgets:
        cells = []
        for t in tokens:
            us = statistics.median(r[t]["ubep"] for r in runs[b])
            share = statistics.median(r[t]["of_floor"] for r in runs[b])
            cells.append(f"{us:,.0f}, {share:.0%}")
        print(f"| {b} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"ranks": args.ranks, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()

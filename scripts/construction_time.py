"""Buffer construction time per rank, with a cold and a warm numba cache (issues 36 and 42).

Each run is a fresh interpreter in which R ranks of `ubep.LocalLaunch` each time one
`ubep.Buffer` (hidden 256, 32 experts, 8 tokens, the defaults otherwise) and then one
dispatch + combine. Cold: an empty NUMBA_CACHE_DIR; warm: the directory the cold run
filled. The first table gives, per case, the median over runs of the slowest rank's times
(build: the phases import, engine and group below).

The second splits a rank's time into phases, each as wall seconds / CPU seconds of the
rank's process (median over ranks and runs): the CPU column is what 2 cores shared by R
ranks must find, the wall column what load adds to it.

- import: the numba engine's modules (numba itself), where the fork server did not;
- engine: `ready_engine` as the Buffer calls it (the cache checked, kernels loaded or
  compiled, warm-up calls);
- group: the rest of the constructor (joining the group, the handshake, shared memory);
- first call: the first dispatch + combine (kernels not yet loaded load here).

    PYTHONPATH=src python scripts/construction_time.py --ranks 8,4,2 --repeats 3
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
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
HIDDEN, EXPERTS, TOKENS = 256, 32, 8
PHASES = ("import", "engine", "group", "first call")


def timed(phase: str, times: dict[str, list[float]], step: Callable[[], object]) -> object:
    """Run `step`, recording [wall s, CPU s of this process] under `phase`."""
    w0, c0 = time.perf_counter(), time.process_time()
    out = step()
    times[phase] = [time.perf_counter() - w0, time.process_time() - c0]
    return out


def one_rank() -> dict[str, list[float]]:
    """This rank's [wall, CPU] seconds per phase, and "build": what a Buffer constructor pays,
    numba's import included (the first Buffer of a process imports the numba engine)."""
    import importlib

    import torch

    import ubep
    from ubep import settings
    from ubep.factory import ready_engine
    from ubep.protocols.warmup import needed

    times: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    timed("import", times, lambda: importlib.import_module("ubep.engine.numba_engine"))
    engine = settings.resolve({"engine": None})["engine"].value
    warm_ups = needed(settings.resolve({"protocol": None})["protocol"].value, False, 1)
    timed("engine", times, lambda: ready_engine(engine, warm_ups, time.monotonic() + 300))
    buf = timed(
        "group", times, lambda: ubep.Buffer(hidden=HIDDEN, num_experts=EXPERTS, max_tokens_per_rank=TOKENS)
    )
    times["build"] = [time.perf_counter() - t0, sum(times[p][1] for p in ("import", "engine", "group"))]
    x = torch.ones(TOKENS, HIDDEN, dtype=torch.bfloat16, device="cpu")
    idx = torch.arange(TOKENS * 2, dtype=torch.int64, device="cpu").view(TOKENS, 2) % EXPERTS
    w = torch.full((TOKENS, 2), 0.5, dtype=torch.float32, device="cpu")

    def first_call() -> None:
        got = buf.dispatch(x, topk_idx=idx, topk_weights=w)
        buf.combine(got.recv_x, got.handle)

    timed("first call", times, first_call)
    buf.close()
    return times


def child(ranks: int) -> None:
    """One run: every rank's times, as JSON on the last line of stdout."""
    import ubep

    print(json.dumps(ubep.LocalLaunch(world_size=ranks, timeout_s=900).run(one_rank)))


def run_once(ranks: int, cache: str) -> list[dict[str, list[float]]]:
    env = {**os.environ, "NUMBA_CACHE_DIR": cache}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, env.get("PYTHONPATH", "")) if p)
    code = f"import construction_time; construction_time.child({ranks})"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1200, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"{ranks} ranks failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--ranks", default="8,4,2", help="comma list of world sizes")
    parser.add_argument("--repeats", type=int, default=3, help="runs per case (each cold run a new cache)")
    parser.add_argument("--cold-repeats", type=int, help="cold runs per size (default: --repeats; 0: none)")
    parser.add_argument("--cache", help="a warm cache directory for the warm runs (default: the cold run's)")
    args = parser.parse_args()
    cases = []
    print(f"# {load()}", flush=True)
    for R in (int(r) for r in args.ranks.split(",")):
        with tempfile.TemporaryDirectory(prefix="ubep_numba_") as root:
            cold_runs = args.repeats if args.cold_repeats is None else args.cold_repeats
            cold = [run_once(R, os.path.join(root, f"cold{i}")) for i in range(cold_runs)]
            cache = args.cache or os.path.join(root, f"cold{cold_runs - 1}")
            warm = [run_once(R, cache) for _ in range(args.repeats)]
        cases += [(R, name, runs) for name, runs in (("cold", cold), ("warm", warm)) if runs]
        print(f"# {R} ranks done, {load()}", flush=True)
    columns = ("build, slowest rank (s)", "build, median rank (s)", "first call, slowest (s)", "runs")
    print("| ranks | cache | " + " | ".join(columns) + " |")
    print("|---|---|---|---|---|---|")
    for R, name, runs in cases:
        slowest = statistics.median(max(r["build"][0] for r in run) for run in runs)
        median = statistics.median(statistics.median(r["build"][0] for r in run) for run in runs)
        first = statistics.median(max(r["first call"][0] for r in run) for run in runs)
        print(f"| {R} | {name} | {slowest:.2f} | {median:.2f} | {first:.2f} | {len(runs)} |")
    print("\n| ranks | cache | " + " | ".join(f"{p}: wall / CPU (s)" for p in PHASES) + " |")
    print("|---|---|" + "---|" * len(PHASES))
    for R, name, runs in cases:
        cells = []
        for phase in PHASES:
            wall, cpu = (statistics.median(r[phase][i] for run in runs for r in run) for i in (0, 1))
            cells.append(f"{wall:.2f} / {cpu:.2f}")
        print(f"| {R} | {name} | " + " | ".join(cells) + " |")
    print(f"# {load()}")


if __name__ == "__main__":
    main()

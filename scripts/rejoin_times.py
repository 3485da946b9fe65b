"""How long a restarted rank takes to rejoin, and how long the survivors pause for it.

Runs `tests/reliability/test_rejoin.py`'s scenario (6 ranks on shm, rank 4 killed and masked) with
`--rejoins` restarted processes in turn, each taken in, then killed again after a few pairs (the last
one stays): every call on every rank is checked against the reference, as in the test. Prints, over
the rejoins, the median and worst of

- start -> first exact call: from rank 0 starting the restarted process (a fresh interpreter) to the
  end of its first call pair, checked exact (the admitting dispatch and its combine);
- the survivors' pause: the pair whose dispatch took it in, on the slowest survivor, less the median
  pair with every rank in;
- where the start went, stage by stage, as the restarted process noted it (`restarted_rank`, then
  `Rejoining.stages`): each stage's time since the one before, from the start of the interpreter to
  the first exact call pair, and the CPU seconds the process spent in it (what a shared machine does
  not stretch); and whether its numba kernels came from the cache;
- the floor: `import torch` alone in a fresh interpreter, timed just before and after, and the load
  average (the machine may be shared).

    python scripts/rejoin_times.py --rejoins 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / d) for d in ("support", "api", "reliability")]

from test_rejoin import run  # noqa: E402  (the test's scenario, after its folders are importable)


def import_torch_s() -> float:
    """Seconds from starting a fresh interpreter to the end of its `import torch`."""
    begun = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.monotonic() - begun


def summary(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f} s, worst {max(values):.3f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rejoins", type=int, default=5, help="restarted processes taken in, in turn")
    args = parser.parse_args()
    loads = [os.getloadavg()[0]]
    floors = [import_torch_s()]
    results = run(["after"] * (args.rejoins - 1) + [""])
    floors.append(import_torch_s())
    loads.append(os.getloadavg()[0])
    joiners = results[0]["joiners"]
    starts = [j["first_exact_s"] for j in joiners]
    joins = [j["joined_s"] for j in joiners]
    pauses = [max(r["pauses"][i] - r["clean"] for r in results) for i in range(args.rejoins)]
    clean = statistics.median(r["clean"] for r in results)
    for name, values in (
        ("start -> Buffer.rejoin returned", joins),
        ("start -> first exact call pair", starts),
        ("survivors' pause (admitting pair less a clean one)", pauses),
    ):
        print(f"{name}: {summary(values)}, n={len(values)}")
    print(f"clean pair with every rank in, median over survivors: {clean:.4f} s")
    print("the start, stage by stage (each stage's time since the one before, in the restarted process):")
    stages = list(joiners[0]["stages_s"])
    for before, stage in zip(["start", *stages], stages, strict=False):
        begun = [j["stages_s"].get(before, [0.0, 0.0]) for j in joiners]  # "start": the launcher's
        ended = [j["stages_s"][stage] for j in joiners]
        spans = [end[0] - begin[0] for begin, end in zip(begun, ended, strict=True)]
        cpu = statistics.median(end[1] - begin[1] for begin, end in zip(begun, ended, strict=True))
        print(f"  {before} -> {stage}: {summary(spans)}; CPU {cpu:.3f} s (median)")
    print(f"numba kernels: {sorted({str(j['kernels']) for j in joiners})}")
    print(f"floor, 'import torch' in a fresh interpreter: {floors[0]:.3f} s before, {floors[1]:.3f} s after")
    print(f"load average (1 min): {loads[0]:.1f} at the start, {loads[1]:.1f} at the end")


if __name__ == "__main__":
    main()

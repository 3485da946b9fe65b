"""How long a restarted rank takes to rejoin, and how long the survivors pause for it.

Runs `tests/reliability/test_rejoin.py`'s scenario (6 ranks on shm, rank 4 killed and masked) with
`--rejoins` restarted processes in turn, each taken in, then killed again after a few pairs (the last
one stays): every call on every rank is checked against the reference, as in the test. Prints, over
the rejoins, the median and worst of

- start -> first exact call: from rank 0 starting the restarted process (a fresh interpreter) to the
  end of its first call pair, checked exact (the admitting dispatch and its combine);
- the survivors' pause: the pair whose dispatch took it in, on the slowest survivor, less the median
  pair with every rank in.

    python scripts/rejoin_times.py --rejoins 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / d) for d in ("support", "api", "reliability")]

from test_rejoin import run  # noqa: E402  (the test's scenario, after its folders are importable)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rejoins", type=int, default=5, help="restarted processes taken in, in turn")
    args = parser.parse_args()
    results = run(["after"] * (args.rejoins - 1) + [""])
    starts = [j["first_exact_s"] for j in results[0]["joiners"]]
    joins = [j["joined_s"] for j in results[0]["joiners"]]
    pauses = [max(r["pauses"][i] - r["clean"] for r in results) for i in range(args.rejoins)]
    clean = statistics.median(r["clean"] for r in results)
    for name, values in (
        ("start -> Buffer.rejoin returned", joins),
        ("start -> first exact call pair", starts),
        ("survivors' pause (admitting pair less a clean one)", pauses),
    ):
        print(f"{name}: median {statistics.median(values):.3f} s, worst {max(values):.3f} s, n={len(values)}")
    print(f"clean pair with every rank in, median over survivors: {clean:.4f} s")


if __name__ == "__main__":
    main()

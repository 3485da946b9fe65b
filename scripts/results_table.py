"""The table of the newest bench numbers, from the results files in docs/results/ (`ubep bench --json`).

    .venv/bin/python scripts/results_table.py            print it (Markdown)
    .venv/bin/python scripts/results_table.py --write    put it at the top of docs/benchmarks.md

Per command (the `ubep bench` flags that reproduce the run, from each file's configuration), the
complete runs of its newest day: ubep's dispatch + combine, and every other row's time over ubep's,
medians over those runs (`ubep.bench.results`). tests/tools/test_docs.py checks that the table in
the doc is the one this prints, so a new results file goes in with the table it changes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ubep.bench.results import BEGIN, END, markdown, newest_runs, read_folder

ROOT = Path(__file__).resolve().parents[1]
RESULTS, DOC = ROOT / "docs" / "results", ROOT / "docs" / "benchmarks.md"


def table(folder: Path = RESULTS) -> str:
    return markdown(newest_runs(read_folder(folder)))


def write(doc: Path, text: str) -> None:
    """Replace what lies between the doc's markers with `text`; ValueError where they are missing."""
    old = doc.read_text()
    if BEGIN not in old or END not in old:
        raise ValueError(f"{doc} has no {BEGIN} ... {END} block to put the table in")
    head, rest = old.split(BEGIN, 1)
    doc.write_text(f"{head}{BEGIN}\n{text}\n{END}{rest.split(END, 1)[1]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write it into {DOC.relative_to(ROOT)}")
    args = parser.parse_args()
    text = table()
    if args.write:
        write(DOC, text)
        print(f"wrote the table into {DOC.relative_to(ROOT)}")
    else:
        print(text)


if __name__ == "__main__":
    main()

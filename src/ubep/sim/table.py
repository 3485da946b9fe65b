"""Plain-text tables for `ubep simulate` and `ubep plan`: aligned columns from the standard library
alone (so both commands run after a plain install), never cut; within WIDTH columns, a last
column of prose (left-aligned) wraps onto continuation lines under itself.

    render("EP8 on cm384", ["tokens", "dispatch us"], [["8", "63.8"]])

    EP8 on cm384
    tokens  dispatch us
    ------  -----------
         8         63.8
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

GAP = "  "
WIDTH = 120  # the widest a line of a table gets, where its last column is prose that can wrap


def render(
    title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], left: Sequence[str] = ()
) -> str:
    """`title`, then the columns: right-aligned, but those named in `left`; cells are strings. A
    left-aligned last column wraps at spaces to keep lines within WIDTH (where the others leave it
    at least 40 columns)."""
    widths = [max(len(name), *(len(row[i]) for row in rows)) for i, name in enumerate(columns)]
    before = sum(widths[:-1]) + len(GAP) * (len(columns) - 1)
    if columns[-1] in left and before + widths[-1] > WIDTH and WIDTH - before >= 40:
        widths[-1] = max(len(columns[-1]), WIDTH - before)

    def line(cells: Sequence[str]) -> str:
        padded = [
            cell.ljust(w) if name in left else cell.rjust(w)
            for cell, w, name in zip(cells, widths, columns, strict=True)
        ]
        return GAP.join(padded).rstrip()

    def lines(cells: Sequence[str]) -> list[str]:
        if len(cells[-1]) <= widths[-1]:
            return [line(cells)]
        first, *rest = textwrap.wrap(cells[-1], widths[-1], break_long_words=False)
        return [line([*cells[:-1], first]), *(line([""] * (len(cells) - 1) + [more]) for more in rest)]

    body = [text for row in rows for text in lines(row)]
    return "\n".join([title, line(columns), GAP.join("-" * w for w in widths), *body])

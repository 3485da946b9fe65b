"""Plain-text tables for `ubep simulate` and `ubep plan`: aligned columns from the standard library
alone (so both commands run after a plain install), every row on one line, never cut or wrapped
to the terminal's width.

    render("EP8 on cm384", ["tokens", "dispatch us"], [["8", "63.8"]])

    EP8 on cm384
    tokens  dispatch us
    ------  -----------
         8         63.8
"""

from __future__ import annotations

from collections.abc import Sequence

GAP = "  "


def render(
    title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], left: Sequence[str] = ()
) -> str:
    """`title`, then the columns: right-aligned, but those named in `left`; cells are strings."""
    widths = [max(len(name), *(len(row[i]) for row in rows)) for i, name in enumerate(columns)]

    def line(cells: Sequence[str]) -> str:
        padded = [
            cell.ljust(w) if name in left else cell.rjust(w)
            for cell, w, name in zip(cells, widths, columns, strict=True)
        ]
        return GAP.join(padded).rstrip()

    return "\n".join([title, line(columns), GAP.join("-" * w for w in widths), *(line(r) for r in rows)])

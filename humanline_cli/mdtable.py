"""Markdown pipe tables, the one writer behind docs/config.md's key tables and every table of `humanline report`:
`md_table` from a header and rows of cells, `md_frame` from a data frame with per-column formats."""
from __future__ import annotations


def md_table(head, rows) -> list[str]:
    """Lines of a pipe table; a `|` inside a cell is escaped so it cannot open a column."""
    def line(cells) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return [line(head), "|" + "---|" * len(head), *map(line, rows)]


def md_frame(df, fmt: dict | None = None) -> list[str]:
    """A data frame as a pipe table, headers with spaces for underscores; `fmt`: column -> a format string or a
    function of the cell; a missing value shows as "–"."""
    def cell(c, x):
        f = (fmt or {}).get(c)
        if x is None or (isinstance(x, float) and x != x):
            return "–"
        return f(x) if callable(f) else f.format(x) if f else x

    return md_table([str(c).replace("_", " ") for c in df.columns],
                 [[cell(c, x) for c, x in zip(df.columns, row)] for row in df.itertuples(index=False)])

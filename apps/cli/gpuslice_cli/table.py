"""Tables for a terminal and for a pipe.

On a terminal a table is drawn by rich, as wide as the terminal; a cell too
long for its column ends in an ellipsis. Written to a pipe or a file, the same
table is plain tab-separated columns (a header line, then a line per row),
every cell whole, so ``cut``, ``awk`` and ``grep`` read it.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

ELLIPSIS = "…"


def shorten(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters, cut with an ellipsis where it is longer."""
    if len(text) <= width:
        return text
    return text[: max(width - 1, 0)] + ELLIPSIS


def _plain(cell: object) -> str:
    """A cell's text without markup, on one line, without tabs."""
    text = cell.plain if isinstance(cell, Text) else Text.from_markup(str(cell)).plain
    return " ".join(text.split())


def plain_lines(table: Table) -> list[str]:
    """The table as tab-separated lines: its title (when it has one), the
    header, the rows, then its caption (when it has one)."""
    lines = []
    if table.title:
        lines.append(f"# {_plain(table.title)}")
    lines.append("\t".join(_plain(column.header) for column in table.columns))
    cells = [[_plain(cell) for cell in column.cells] for column in table.columns]
    for row in zip(*cells, strict=True):
        lines.append("\t".join(row))
    if table.caption:
        lines.append(f"# {_plain(table.caption)}")
    return lines


def show(console: Console, table: Table) -> None:
    """Draw ``table`` on a terminal, or write it as plain columns elsewhere."""
    if console.is_terminal:
        console.print(table)
        return
    for line in plain_lines(table):  # as they are: rich would turn the tabs into spaces
        print(line, file=console.file)

"""Tables for a terminal and for a pipe.

On a terminal a table is drawn by rich, as wide as the terminal; a cell too
long for its column ends in an ellipsis. Written to a pipe or a file, the same
table is plain tab-separated columns (a header line, then a line per row),
every cell whole, so ``cut``, ``awk`` and ``grep`` read it.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys

from rich.console import Console
from rich.table import Table
from rich.text import Text

ELLIPSIS = "…"
# Characters a terminal acts on rather than shows: C0 controls but tab and
# newline (ESC starts the sequences that clear the screen, set the title or
# write a hyperlink), DEL, the C1 controls (\x9b is a one-byte CSI), and the
# bidi controls that show text in another order than it is.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
REPLACEMENT = "\ufffd"


def closed_pipe() -> None:
    """The reader of stdout went away (``| head -1``): a normal end for a
    command that writes lines. What is still buffered goes nowhere, quietly
    (not as a BrokenPipeError when Python flushes stdout at exit)."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def printable(text: str) -> str:
    """``text`` with each character a terminal would act on shown as U+FFFD
    (one for one, so that styled spans keep their places). Names, reasons and
    events come from pod files, tenants' pods and nodes: never raw to a terminal."""
    return _CONTROL.sub(REPLACEMENT, text)


def _printable_cell(cell: object) -> object:
    if isinstance(cell, Text):
        clean = cell.copy()
        clean.plain = printable(cell.plain)
        return clean
    if isinstance(cell, str):
        return printable(cell)
    return cell


def make_printable(table: Table) -> Table:
    """``table`` (changed in place) with no character a terminal would act on
    in its title, caption, headers or cells."""
    table.title = _printable_cell(table.title)  # type: ignore[assignment]
    table.caption = _printable_cell(table.caption)  # type: ignore[assignment]
    for column in table.columns:
        column.header = _printable_cell(column.header)  # type: ignore[assignment]
        column._cells[:] = [_printable_cell(cell) for cell in column._cells]  # type: ignore[misc]
    return table


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
    """Draw ``table`` on a terminal, or write it as plain columns elsewhere;
    either way without control characters (:func:`printable`)."""
    make_printable(table)
    if console.is_terminal:
        console.print(table)
        return
    for line in plain_lines(table):  # as they are: rich would turn the tabs into spaces
        print(line, file=console.file)

"""What the CLI writes: reasons cut with an ellipsis, tables drawn for a
terminal and plain for a pipe, the summary of pods that did not succeed, and
libraries' own output kept out of the view."""

from __future__ import annotations

import io
import logging
import os
import sys
from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table
from rich.text import Text

from gpuslice_cli.dev.driver import ContainerRun, PodOutcome
from gpuslice_cli.dev.up import (
    View,
    failures,
    foreign_output_to,
    pods_table,
)
from gpuslice_cli.table import plain_lines, shorten, show

LONG = "0/2 nodes are available: gpu-node-1: CardInsufficientMemory; gpu-node-2: TooManyCores"


def test_shorten_cuts_with_an_ellipsis_only_what_is_too_long() -> None:
    assert shorten("short", 10) == "short"
    assert shorten("exactly10!", 10) == "exactly10!"
    assert shorten("eleven char", 10) == "eleven ch…"
    assert len(shorten(LONG, 40)) == 40


def drawn(table: Table, width: int) -> str:
    out = io.StringIO()
    show(Console(file=out, width=width, force_terminal=True, color_system=None), table)
    return out.getvalue()


def test_the_live_view_cuts_reasons_with_an_ellipsis_and_the_summary_keeps_them_whole() -> None:
    pod = PodOutcome("p", "default", "uid", "Unschedulable", LONG)
    live = drawn(pods_table([pod], reason_width=30), 200)
    assert shorten(LONG, 30) in live
    assert LONG not in live
    whole = drawn(pods_table([pod]), 300)
    assert LONG in whole


def test_a_table_on_a_terminal_fits_its_width_and_in_a_pipe_is_whole_tab_separated() -> None:
    table = Table(title="t", caption="from here")
    table.add_column("a")
    table.add_column("reason")
    table.add_row("x", LONG)
    table.add_row("[red]y[/]", "two\tcolumns\nand lines")
    narrow = drawn(table, 40)
    assert max(len(line) for line in narrow.splitlines()) <= 40
    assert "┃" in narrow
    assert "\t" not in narrow
    out = io.StringIO()
    show(Console(file=out, width=40), table)  # not a terminal
    assert out.getvalue().splitlines() == plain_lines(table)
    assert plain_lines(table) == [
        "# t",
        "a\treason",
        f"x\t{LONG}",
        "y\ttwo columns and lines",  # a cell never breaks the columns
        "# from here",
    ]


def test_failures_name_each_pod_and_show_the_end_of_a_failed_containers_output(
    tmp_path: Path,
) -> None:
    log = tmp_path / "main.log"
    output = "".join(f"line {i}\n" for i in range(1, 31))
    failed = PodOutcome("bad", "ns", "u1", "Failed", "containers failed: main (exit 3)")
    failed.containers.append(ContainerRun("main", 3, output, log_path=log))
    failed.containers.append(ContainerRun("side", 0, "fine\n"))
    fine = PodOutcome("good", "ns", "u2", "Succeeded")
    denied = PodOutcome("greedy", "ns", "", "Denied", "exceeded quota")
    assert failures([fine, failed, denied]) == [
        "pod ns/bad: Failed: containers failed: main (exit 3)",
        f"  container main exited 3; its output ({log}) ends:",
        *(f"    line {i}" for i in range(11, 31)),
        "pod ns/greedy: Denied: exceeded quota",
    ]
    assert failures([fine]) == []


def test_what_libraries_write_goes_to_the_log_and_only_our_own_messages_out(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "gpuslice-dev.log"
    with foreign_output_to(log):
        os.write(2, b"E1124 18:00:00.000000 1 chttp2_transport.cc:1] a C library's line\n")
        logging.getLogger("some.library").warning("a library's warning")
        print("our own message", file=sys.stderr)
    os.write(2, b"after the block\n")
    captured = capfd.readouterr()
    assert captured.err == "our own message\nafter the block\n"
    kept = log.read_text()
    assert "a C library's line" in kept
    assert "a library's warning" in kept
    assert "our own message" not in kept


def test_names_and_reasons_that_look_like_markup_are_shown_as_they_are() -> None:
    """A pod's name, a reason or an event comes from outside: never read as markup."""
    pod = PodOutcome("[bold]x[/]", "ns", "uid", "Denied", "bad [/] value [red]")
    view = View(pods=[pod], steps=[("a [/] step", False, "detail [/x]")])
    view.events.append("12:00:00 allocated ns/[/]pod")
    out = io.StringIO()
    Console(file=out, width=200, force_terminal=True, color_system=None).print(view.render())
    for text in ("ns/[bold]x[/]", "bad [/] value [red]", "a [/] step", "detail [/x]", "ns/[/]pod"):
        assert text in out.getvalue()


# what a tenant's annotation, a compromised node's inventory or event, or a pod
# file can put in a name or a reason: escape sequences (clear the screen, set
# the title, rewrite the line), C1 controls, and bidi overrides
HOSTILE = "evil\x1b[2J\x1b]0;owned\x1b\\\x9b31m\u202etxt.exe\x07\rX"


def _unsafe(text: str) -> list[str]:
    return [c for c in text if c in "\x1b\x9b\u202e\x07\r"]


def test_control_characters_in_cells_never_reach_the_terminal_or_the_pipe() -> None:
    table = Table(title=f"t {HOSTILE}", caption=HOSTILE)
    table.add_column("pod")
    table.add_column("reason")
    table.add_row(HOSTILE, Text(HOSTILE, style="red"))
    pod = PodOutcome(HOSTILE, HOSTILE, "uid", "Denied", HOSTILE, node=HOSTILE)
    for drawn_table in (table, pods_table([pod]), pods_table([pod], reason_width=30)):
        out = io.StringIO()
        show(Console(file=out, width=200, force_terminal=True, color_system=None), drawn_table)
        assert _unsafe(out.getvalue()) == []
        assert "evil" in out.getvalue()
        out = io.StringIO()
        show(Console(file=out, width=200), drawn_table)  # piped (into less -R, say)
        assert _unsafe(out.getvalue()) == []
        assert "evil" in out.getvalue()


def test_the_live_view_and_the_summary_show_no_control_characters() -> None:
    pod = PodOutcome(HOSTILE, "ns", "uid", "Failed", HOSTILE)
    pod.containers.append(ContainerRun(HOSTILE, 3, f"{HOSTILE}\n"))
    view = View(pods=[pod], steps=[(HOSTILE, False, HOSTILE)])
    view.events.append(f"12:00:00 allocated ns/{HOSTILE}")
    out = io.StringIO()
    Console(file=out, width=200, force_terminal=True, color_system=None).print(view.render())
    assert _unsafe(out.getvalue()) == []
    for line in failures([pod]):
        assert _unsafe(line) == []
        assert "\n" not in line


def test_audit_follow_lines_hold_no_control_characters_nor_line_breaks() -> None:
    from gpuslice_cli.audit import follow_line

    line = follow_line(["12:00:00", "allocated", f"ns/{HOSTILE}", HOSTILE, f"a\n{HOSTILE}"])
    assert _unsafe(line) == []
    assert "\n" not in line
    assert "evil" in line


def test_warnings_and_errors_from_events_and_the_ledger_show_no_control_characters(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A malformed event's or an unreadable record's text can quote what a node sent."""
    import typer

    from gpuslice_cli.audit import _warn
    from gpuslice_cli.status import fail

    _warn(f"stream sequence 7: bad node {HOSTILE}")
    with pytest.raises(typer.Exit):
        fail(f"node {HOSTILE} is not in the ledger", 1)
    err = capsys.readouterr().err
    assert "evil" in err
    assert _unsafe(err) == []


@pytest.mark.parametrize(
    ("namespace", "name", "containers"),
    [
        ("..", "../../etc", ["../passwd", "a/b", "a_b"]),
        ("/abs", "x\x00y", ["\x00", ".", "..", ".hidden"]),
        ("ns", "p" * 5000, ["c" * 5000, "c" * 4999 + "d"]),
        ("ns", "p", ["main", "m.a.i.n", "m_a_i_n", "m/a/i/n"]),
    ],
)
def test_container_logs_stay_in_the_log_directory_one_file_per_container(
    tmp_path: Path, namespace: str, name: str, containers: list[str]
) -> None:
    """Names come from pod files: none leaves the log directory, and two
    containers of a pod never share (and truncate) one file."""
    from types import SimpleNamespace
    from typing import Any, cast

    from gpuslice_cli.dev.driver import ClusterDriver

    driver = cast(Any, SimpleNamespace(log_dir=tmp_path / "pods"))
    pod = {"metadata": {"namespace": namespace, "name": name, "uid": "0123456789abcdef"}}
    paths = [ClusterDriver.log_path(driver, pod, c) for c in containers]
    assert len(set(paths)) == len(paths)
    for path in paths:
        assert path.resolve().is_relative_to((tmp_path / "pods").resolve())
        assert path.parent.parent.parent == tmp_path / "pods"
        assert all(len(part) <= 120 and "\x00" not in part for part in path.parts)

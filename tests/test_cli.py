"""The gpuslice command, run as a user would, against real servers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

from gpuslice_cli.main import app
from gpuslice_common.servers import NatsServer, RedisServer, free_port

ROOT = Path(__file__).resolve().parent.parent


def gpuslice(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuslice_cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "160", **(env or {})},
        cwd=ROOT,
        check=False,
    )


def test_version() -> None:
    result = gpuslice("version")
    assert result.returncode == 0
    assert result.stdout.startswith("gpuslice ")


def test_smoke_passes_and_can_run_again_on_the_same_servers(
    nats_server: NatsServer, redis_server: RedisServer, prefix: str
) -> None:
    urls = ["--nats-url", nats_server.url, "--redis-url", redis_server.url]
    env = {"GPUSLICE_SUBJECT_PREFIX": prefix, "GPUSLICE_LEDGER_PREFIX": prefix}
    for _ in range(2):
        result = gpuslice("dev", "smoke", *urls, env=env)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "smoke scenario passed" in result.stdout
        assert "FAIL" not in result.stdout
        assert "the audit stream holds all 13 events" in result.stdout


def test_unreachable_servers_are_a_clear_error_not_a_traceback() -> None:
    dead = f"nats://127.0.0.1:{free_port()}"
    result = gpuslice(
        "dev",
        "smoke",
        "--nats-url",
        dead,
        "--redis-url",
        "redis://127.0.0.1:1/0",
        env={"GPUSLICE_CONNECT_WAIT": "300ms"},
    )
    assert result.returncode == 2
    assert f"cannot connect to NATS at {dead}" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_bad_settings_name_the_variable() -> None:
    result = gpuslice(
        "dev",
        "smoke",
        "--nats-url",
        "nats://127.0.0.1:1",
        "--redis-url",
        "redis://x",
        env={"GPUSLICE_AUDIT_MAX_AGE": "forever"},
    )
    assert result.returncode == 2
    assert "GPUSLICE_AUDIT_MAX_AGE" in result.stderr
    assert "Traceback" not in result.stderr


def test_make_says_what_it_installs_before_each_slow_step(tmp_path: Path) -> None:
    """``make demo`` on a fresh machine, as a dry run: each slow step (the
    virtualenv, pip, the system's package manager, the native build) comes
    after its own line saying what it does."""
    result = subprocess.run(
        ["make", "-s", "-n", "demo", f"VENV={tmp_path / 'venv'}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    slow = ("-m venv", "pip install", " update -qq", "-C native")
    steps = [i for i, line in enumerate(lines) if any(s in line for s in slow)]
    assert len(steps) >= 6, result.stdout
    said = [i for i, line in enumerate(lines) if line.lstrip().startswith('echo "make: ')]
    previous = -1
    for step in steps:
        assert any(previous < i < step for i in said), f"nothing says what {lines[step]!r} does"
        previous = step
    assert result.stderr == ""


def commands(group: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The command path of the group and of every command under it."""
    yield path
    for name, command in getattr(group, "commands", {}).items():
        yield from commands(command, (*path, name))


def test_help_shows_flags_without_a_value_and_no_panels() -> None:
    """Every command's help: a flag (--json, --demo, --help) takes no value, so
    none is shown after it; plain text, as the rest of the command writes."""
    every = list(commands(typer.main.get_command(app)))
    assert ("status",) in every
    assert ("dev", "up") in every
    for path in every:
        result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "160"})
        assert result.exit_code == 0, (path, result.output)
        assert "<bool>" not in result.output, (path, result.output)
        assert "│" not in result.output, (path, result.output)
        assert "--help" in result.output
    flags = CliRunner().invoke(app, ["status", "--help"], env={"COLUMNS": "160"}).output
    assert re.search(r"^  --json +print a JSON document instead$", flags, re.MULTILINE), flags


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (
            ["dev", "up", "--nodes", "99"],
            "error: Invalid value for '--nodes': Input should be less than or equal to 8"
            " (see gpuslice dev up --help)",
        ),
        (
            ["status", "--nodes"],
            "error: No such option: --nodes (Possible options: --node, --pods)"
            " (see gpuslice status --help)",
        ),
        (["nothing"], "error: No such command 'nothing'. (see gpuslice --help)"),
        (
            ["audit", "export"],
            "error: Missing option '--since'. (see gpuslice audit export --help)",
        ),
    ],
)
def test_a_bad_command_line_is_one_line(args: list[str], said: str) -> None:
    result = gpuslice(*args)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == said + "\n"


def test_a_command_group_without_a_command_shows_its_help() -> None:
    result = gpuslice("audit")
    assert result.returncode == 2
    assert result.stderr.startswith("Usage: gpuslice audit [OPTIONS] COMMAND [ARGS]...")
    assert "error:" not in result.stderr


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (
            b"metadata: {name: a}\nspec: [\n  b",
            ", line 3, column 4: while parsing a flow sequence"
            " expected ',' or ']', but got '<stream end>'",
        ),
        (
            b"metadata:\n\tname: a\n",
            ", line 2, column 1: while scanning for the next token"
            " found character '\\t' that cannot start any token",
        ),
        (b'metadata: {name: "\xff"}\n', ", byte 18: invalid start byte"),
    ],
    ids=["unclosed", "tab", "not-utf8"],
)
def test_a_pod_file_that_is_not_yaml_is_named_with_its_line(
    tmp_path: Path, text: bytes, said: str
) -> None:
    """One line naming the file and where in it (not PyYAML's ``<unicode
    string>``); the directory made for the run does not stay behind."""
    pods = tmp_path / "pods.yaml"
    pods.write_bytes(text)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    result = gpuslice("dev", "up", "--gpu", "fake", str(pods), env={"TMPDIR": str(scratch)})
    assert result.returncode == 2
    assert result.stderr == f"error: cannot read pods from {pods}{said}\n"
    assert "Traceback" not in result.stdout + result.stderr
    assert list(scratch.iterdir()) == []

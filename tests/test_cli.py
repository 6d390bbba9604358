"""The gpuslice command, run as a user would, against real servers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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

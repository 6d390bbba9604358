"""``gpuslice dev up`` as a newcomer runs it: the demo passes, and Ctrl-C leaves no
process of the stack behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import Native

GPUSLICE = str(Path(sys.executable).parent / "gpuslice")


def survivors(workdir: Path) -> list[str]:
    """Processes whose command line or environment names the stack's directory."""
    found = []
    mark = str(workdir).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            seen = (entry / "cmdline").read_bytes() + (entry / "environ").read_bytes()
        except OSError:
            continue
        if mark in seen:
            found.append(f"{entry.name}: {(entry / 'cmdline').read_bytes()!r}")
    return found


def dev_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSLICE_")}
    env["PYTHONFAULTHANDLER"] = "1"
    return env


@pytest.mark.parametrize("shape", [[], ["--ha"]], ids=["single", "ha"])
def test_the_demo_passes_and_leaves_nothing_running(
    native: Native, tmp_path: Path, shape: list[str]
) -> None:
    """Also in the highly-available shapes: three nats-servers, Redis with its
    replicas and sentinels, two extenders and two inventories, all stopped."""
    workdir = tmp_path / "dev"
    result = subprocess.run(
        [GPUSLICE, "dev", "up", "--demo", "--plain", *shape, "--workdir", str(workdir)],
        env=dev_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "demo passed" in result.stdout
    assert result.stdout.count(" ok ") >= 4  # every step of the scenario
    assert "Traceback" not in result.stdout + result.stderr
    assert survivors(workdir) == []


def test_ctrl_c_stops_every_process_of_the_stack(native: Native, tmp_path: Path) -> None:
    workdir = tmp_path / "dev"
    proc = subprocess.Popen(
        [GPUSLICE, "dev", "up", "--plain", "--workdir", str(workdir)],
        env=dev_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        said = ""
        for line in proc.stdout:
            said += line
            if "the stack is up" in line:
                break
            assert time.monotonic() < deadline, "the stack did not come up"
        else:
            raise AssertionError(f"gpuslice dev up ended early (exit {proc.wait()})")
        assert len(survivors(workdir)) >= 6  # nats, redis, four services, two nodes
        # it says where the servers are and how to read the audit as the auditor
        env_file = workdir / "gpuslice.env"
        assert str(env_file) in said
        assert "NATS at nats://" in said
        assert "Redis at redis://" in said
        audit = audit_tail(env_file)
        assert audit.returncode == 0, audit.stdout + audit.stderr
        # NATS wants a login: the same command without the credential is refused
        anonymous = audit_tail(env_file, login=False)
        assert anonymous.returncode == 1, anonymous.stdout + anonymous.stderr
        assert "cannot connect to NATS" in anonymous.stderr
        proc.send_signal(signal.SIGINT)
        try:
            rest, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)  # PYTHONFAULTHANDLER: every thread's stack
            dump, _ = proc.communicate(timeout=30)
            raise AssertionError(f"no exit 60 s after Ctrl-C:\n{dump[-8000:]}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, rest
    assert "every process of the stack has been shut down" in rest
    assert "Traceback" not in rest
    assert survivors(workdir) == []


def audit_tail(env_file: Path, login: bool = True) -> subprocess.CompletedProcess[str]:
    """``gpuslice audit tail`` with the variables of the stack's env file."""
    env = dev_env()
    for line in env_file.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            if login or name not in ("GPUSLICE_NATS_USER", "GPUSLICE_NATS_PASSWORD"):
                env[name] = value
    return subprocess.run(
        [GPUSLICE, "audit", "tail", "--since", "1h"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_asking_for_a_real_gpu_where_there_is_none_is_one_clear_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [GPUSLICE, "dev", "up", "--gpu", "real", "--demo", "--plain", "--workdir", str(tmp_path)],
        env=dev_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "no NVIDIA GPU here" in result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert survivors(tmp_path) == []


def test_the_highly_available_stack_starts_its_own_servers(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            *(GPUSLICE, "dev", "up", "--ha", "--redis-url", "redis://127.0.0.1:1/0"),
            *("--demo", "--plain", "--workdir", str(tmp_path)),
        ],
        env=dev_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--ha starts its own NATS cluster and Redis" in result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert survivors(tmp_path) == []


def start_stack(workdir: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [GPUSLICE, "dev", "up", "--plain", "--gpu", "fake", "--workdir", str(workdir)],
        env=dev_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if "the stack is up" in line:
            return proc
    raise AssertionError(f"gpuslice dev up ended early (exit {proc.wait()})")


def until_gone(workdir: Path, timeout: float = 20) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := survivors(workdir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_sigterm_stops_the_stack_cleanly(native: Native, tmp_path: Path) -> None:
    workdir = tmp_path / "dev"
    proc = start_stack(workdir)
    try:
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, rest
    assert "Traceback" not in rest
    assert until_gone(workdir) == []

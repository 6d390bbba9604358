"""``gpuslice dev up`` as a newcomer runs it: the demo passes, and Ctrl-C leaves no
process of the stack behind."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.request import urlopen

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


@pytest.fixture
def scratch() -> Iterator[Path]:
    """An empty directory for a run's TMPDIR, short (the stack's Unix sockets
    are made under it), removed after the test."""
    where = Path(tempfile.mkdtemp(prefix="gs-", dir="/tmp"))
    yield where
    shutil.rmtree(where, ignore_errors=True)


def dev_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSLICE_")}
    env["PYTHONFAULTHANDLER"] = "1"
    return env


@pytest.mark.parametrize("shape", [[], ["--ha"], ["--dra"]], ids=["single", "ha", "dra"])
def test_the_demo_passes_and_leaves_nothing_running(
    native: Native, tmp_path: Path, scratch: Path, shape: list[str]
) -> None:
    """Also in the highly-available shapes (three nats-servers, Redis with its
    replicas and sentinels, two extenders and two inventories, all stopped) and
    in DRA mode (claims made, allocated, prepared and released, one more step)."""
    # the run's own directory (no --workdir) is removed at the end; --keep keeps it
    keep = ["--keep"] if "--dra" in shape else []
    # --open hands the console's address to the browser $BROWSER names
    opened = tmp_path / "opened"
    browser = tmp_path / "browser"
    browser.write_text(f'#!/bin/sh\necho "$1" >> {opened}\n')
    browser.chmod(0o755)
    result = subprocess.run(
        [GPUSLICE, "dev", "up", "--demo", "--plain", "--open", *shape, *keep],
        env=dev_env() | {"BROWSER": f"{browser} %s", "TMPDIR": str(scratch)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "demo passed" in result.stdout
    workdir = logs_under(result.stdout)
    assert workdir.parent == scratch
    if keep:
        assert result.stdout.splitlines()[-1] == (
            f"gpuslice dev: logs kept in {workdir}; remove them with:  rm -r {workdir}"
        )
        assert (workdir / "gpuslice-dev.log").is_file()
    else:
        assert "logs kept in" not in result.stdout
        assert list(scratch.iterdir()) == []  # nothing left behind unannounced
    [console] = re.findall(r"console: (http://127\.0\.0\.1:\d+/)", result.stdout)
    assert opened.read_text().split() == [console]
    steps = 5 if "--dra" in shape else 4  # every step of the scenario, piped: plain columns
    assert result.stdout.count("\tok\t") == steps
    assert "\tFAIL\t" not in result.stdout
    assert "Traceback" not in result.stdout + result.stderr
    assert survivors(workdir) == []


def logs_under(said: str) -> Path:
    """The stack's directory, as ``gpuslice dev up`` names it at the start."""
    [where] = re.findall(r"^gpuslice dev: logs under (\S+)", said, re.MULTILINE)
    return Path(where)


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
        assert "NATS at nats://127.0.0.1:" in said
        assert f"(user auditor, its password in {env_file})" in said
        assert "Redis at redis://" in said
        # no secret on the terminal: the password is in the file only this user reads
        exported = env_variables(env_file)
        assert len(exported["GPUSLICE_NATS_PASSWORD"]) >= 16
        assert exported["GPUSLICE_NATS_PASSWORD"] not in said
        assert env_file.stat().st_mode & 0o777 == 0o600
        # the line it prints, run in a shell, loads the variables that reach the stack
        assert loaded(said) == exported
        audit = audit_tail(exported)
        assert audit.returncode == 0, audit.stdout + audit.stderr
        status = subprocess.run(
            [GPUSLICE, "status"],
            env=dev_env() | exported,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stdout + status.stderr
        assert status.stderr == ""  # not the default Redis
        assert f"# read from {exported['GPUSLICE_REDIS_URL']}" in status.stdout
        assert "gpu-node-1\t0\t" in status.stdout
        # the web console it names shows the stack's nodes, and its audit feed reads
        # the stream with the inventory's own NATS credential
        [console] = re.findall(r"console: (http://127\.0\.0\.1:\d+/)", said)
        snapshot = json.loads(urlopen(f"{console}api/v1/cluster", timeout=30).read())
        assert "gpu-node-1" in {node["name"] for node in snapshot["nodes"]}
        audit_page = json.loads(urlopen(f"{console}api/v1/audit", timeout=30).read())
        assert audit_page["truncated"] is False
        # NATS wants a login: the same command without the credential is refused
        anonymous = audit_tail(exported, login=False)
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


def env_variables(env_file: Path) -> dict[str, str]:
    variables = {}
    for line in env_file.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            variables[name] = value
    return variables


def loaded(said: str) -> dict[str, str]:
    """The GPUSLICE_ variables a shell has after the ``set -a; . <file>; set +a``
    line ``gpuslice dev up`` printed."""
    [line] = [line for line in said.splitlines() if line.startswith("set -a; . ")]
    shell = subprocess.run(
        ["sh", "-c", f"{line}\nenv"], env={}, capture_output=True, text=True, check=True
    )
    variables = dict(entry.partition("=")[::2] for entry in shell.stdout.splitlines())
    return {k: v for k, v in variables.items() if k.startswith("GPUSLICE_")}


def audit_tail(variables: dict[str, str], login: bool = True) -> subprocess.CompletedProcess[str]:
    """``gpuslice audit tail`` with the stack's variables."""
    env = dev_env()
    for name, value in variables.items():
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


POD_FILE = """
metadata: {name: hami-pod}
spec:
  schedulerName: hami-scheduler
  containers:
  - {name: main, image: cuda, command: [probe, init],
     resources: {limits: {nvidia.com/gpu: 1, nvidia.com/gpumem: 1000}}}
---
metadata: {name: fine}
spec:
  containers:
  - {name: main, image: cuda, command: [probe, init],
     resources: {limits: {nvidia.com/gpu: 1, nvidia.com/gpumem: 1000}}}
---
metadata: {name: too-many-cores}
spec:
  containers:
  - {name: main, image: cuda, command: [probe, init],
     resources: {limits: {nvidia.com/gpu: 1, nvidia.com/gpucores: 200}}}
---
metadata: {name: not-installed}
spec:
  containers:
  - {name: main, image: cuda, command: [gpuslice-no-such-command, -L],
     resources: {limits: {nvidia.com/gpu: 1, nvidia.com/gpumem: 1000}}}
---
metadata: {name: failing}
spec:
  containers:
  - {name: main, image: cuda,
     command: [sh, -c, "for i in $(seq 1 30); do echo line $i; done; exit 3"],
     resources: {limits: {nvidia.com/gpu: 1, nvidia.com/gpumem: 1000}}}
"""

# a line as absl and gRPC's C core write it: "W1124 18:54:26.513183 20092 log.cc:110] ..."
ABSL_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d", re.MULTILINE)
GRPC_DEBUG_LINE = "Log level DEBUG is not suitable for production"


def test_pods_that_do_not_run_are_reported_with_why_and_fail_the_run(
    native: Native, tmp_path: Path, scratch: Path
) -> None:
    """A pod for another scheduler stays Pending and the run goes on; a denied
    pod and a failed one are named with why, the failed one with the end of
    its output and where the whole is; the exit is non-zero. gRPC's own log
    lines (made plentiful here) stay out of the output, in the stack's log."""
    pods = tmp_path / "pods.yaml"
    pods.write_text(POD_FILE)
    result = subprocess.run(
        [GPUSLICE, "dev", "up", "--gpu", "fake", str(pods)],
        env=dev_env() | {"GRPC_VERBOSITY": "debug", "TMPDIR": str(scratch)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    said = result.stdout + result.stderr
    assert result.returncode == 1, said
    assert "Traceback" not in said
    # after a failure the run's directory stays for its logs, and the end says so
    workdir = logs_under(result.stdout)
    assert workdir.parent == scratch
    assert result.stdout.splitlines()[-1] == (
        f"gpuslice dev: logs kept in {workdir}; remove them with:  rm -r {workdir}"
    )
    rows = {line.split("\t")[0]: line.split("\t") for line in result.stdout.splitlines()}
    # a command that is not installed fails its pod alone, as a shell says it
    assert rows["default/not-installed"][1] == "Failed"
    assert rows["default/not-installed"][4] == (
        "containers failed: main (exit 127: command not found: gpuslice-no-such-command)"
    )
    assert rows["default/hami-pod"][1:] == [
        "Pending",
        "-",
        "-",
        "names scheduler hami-scheduler, which this stack does not run",
    ]
    assert rows["default/fine"][1:3] == ["Succeeded", "gpu-node-1"]
    # the whole reason, not cut
    assert rows["default/too-many-cores"][1] == "Denied"
    assert rows["default/too-many-cores"][4].endswith("must be between 0 and 100, got 200")
    assert rows["default/failing"][1:2] == ["Failed"]
    assert rows["default/failing"][4] == "containers failed: main (exit 3)"
    lines = result.stdout.splitlines()
    assert "pod default/hami-pod: Pending: names scheduler hami-scheduler," in result.stdout
    assert any(line.startswith("pod default/too-many-cores: Denied: ") for line in lines)
    [failing_log] = (workdir / "pods" / "default").glob("failing-*/main.log")
    assert failing_log.read_text().splitlines() == [f"line {i}" for i in range(1, 31)]
    said_where = f"  container main exited 3; its output ({failing_log}) ends:"
    at = lines.index(said_where)
    assert lines[at + 1 : at + 21] == [f"    line {i}" for i in range(11, 31)]
    assert "4 of 5 pods did not succeed" in result.stdout
    # every container that ran kept its output
    assert [p.parent.name.rsplit("-", 1)[0] for p in sorted(workdir.glob("pods/*/*/*.log"))] == [
        "failing",
        "fine",
        "not-installed",
    ]
    [missing_log] = (workdir / "pods" / "default").glob("not-installed-*/main.log")
    assert missing_log.read_text() == "command not found: gpuslice-no-such-command\n"
    assert "  container main exited 127; its output" in result.stdout
    assert ABSL_LINE.search(said) is None, said
    assert GRPC_DEBUG_LINE in (workdir / "gpuslice-dev.log").read_text()
    assert survivors(workdir) == []


def in_terminal(argv: list[str], env: dict[str, str], columns: int) -> tuple[int, str]:
    """Run ``argv`` on a pseudo-terminal ``columns`` wide: its exit code and
    what it drew, escape sequences removed."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    proc = subprocess.Popen(argv, stdin=follower, stdout=follower, stderr=follower, env=env)
    os.close(follower)
    drawn = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # it ended and closed the terminal
            break
        if not chunk:
            break
        drawn += chunk
    os.close(leader)
    code = proc.wait(60)
    return code, re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", drawn.decode(errors="replace"))


def test_the_live_view_on_a_terminal_exits_0_when_every_pod_succeeds(
    native: Native, tmp_path: Path
) -> None:
    workdir = tmp_path / "dev"
    pods = tmp_path / "pods.yaml"
    pods.write_text(POD_FILE.split("---")[1])  # the pod that runs
    env = dev_env() | {"GRPC_VERBOSITY": "debug", "TERM": "xterm", "NO_COLOR": "1"}
    for name in ("COLUMNS", "LINES", "TTY_COMPATIBLE", "FORCE_COLOR"):
        env.pop(name, None)
    argv = [GPUSLICE, "dev", "up", "--gpu", "fake", "--workdir", str(workdir), str(pods)]
    code, drawn = in_terminal(argv, env, 150)
    assert code == 0, drawn
    assert "┃" in drawn  # the live view and the summary, drawn
    assert "default/fine" in drawn
    assert "Succeeded" in drawn
    assert "did not succeed" not in drawn
    assert ABSL_LINE.search(drawn) is None, drawn
    assert GRPC_DEBUG_LINE in (workdir / "gpuslice-dev.log").read_text()
    assert survivors(workdir) == []

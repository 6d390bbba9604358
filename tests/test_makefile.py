"""The Makefile's installs and trace targets, run by make itself: the demo
installs only what it needs, apt waits (bounded) for another apt's lock, and
the targets that replay the openb traces say where to get them."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from gpuslice_scheduler.sim import TRACE_SOURCE

ROOT = Path(__file__).resolve().parents[1]
TRACE_FILES = (
    "openb_node_list_gpu_node.csv",
    "openb_pod_list_default.csv",
    "openb_pod_list_gpushare40.csv",
    "openb_pod_list_gpuspec33.csv",
    "openb_pod_list_multigpu50.csv",
)


def make(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "-s", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        check=False,
    )


def dry_run(target: str, tmp_path: Path) -> str:
    """What ``make target`` would run on a fresh machine (a virtualenv not made yet)."""
    result = make("-n", target, f"VENV={tmp_path / 'venv'}")
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_the_demo_installs_only_what_the_demo_needs(tmp_path: Path) -> None:
    demo = dry_run("demo", tmp_path)
    assert "redis-server" in demo
    assert "prometheus" not in demo
    assert "promtool" not in demo
    assert "chromium" not in demo
    tests = dry_run("test", tmp_path)
    assert "install -y -qq --no-install-recommends prometheus" in tests
    assert "chromium" in tests


def test_every_apt_call_waits_for_the_lock(tmp_path: Path) -> None:
    text = dry_run("test", tmp_path) + dry_run("demo", tmp_path)
    calls = re.findall(r"(?<!command -v )apt-get\b.*?\b(?:update|install)\b", text)
    assert len(calls) >= 6  # update and install for redis, promtool, chromium
    for call in calls:
        assert call.startswith("apt-get -o DPkg::Lock::Timeout=300 "), call


def stand_in_apt(tmp_path: Path, lock: str) -> tuple[dict[str, str], Path]:
    """A PATH whose apt-get (and sudo) stand in for the system's: apt-get logs
    each call; update reports ``lock`` on stderr and fails while a count of
    refusals lasts."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "apt.log"
    (bin_dir / "apt-get").write_text(
        "#!/bin/sh\n"
        'echo "$*" >> "$APT_LOG"\n'
        'case "$*" in *" update "*|*" update")\n'
        '  left=$(cat "$APT_REFUSALS"); echo $((left - 1)) > "$APT_REFUSALS"\n'
        '  if [ "$left" -gt 0 ]; then echo "$APT_ERROR" >&2; exit 100; fi;;\n'
        "esac\n"
    )
    (bin_dir / "sudo").write_text('#!/bin/sh\nexec "$@"\n')
    for tool in ("apt-get", "sudo"):
        (bin_dir / tool).chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "APT_LOG": str(log),
        "APT_REFUSALS": str(tmp_path / "refusals"),
        "APT_ERROR": lock,
    }
    (tmp_path / "probe.mk").write_text("probe:\n\t@$(call system_install,the probe,probe-pkg,,)\n")
    return env, log


HELD = "E: Could not get lock /var/lib/apt/lists/lock. It is held by process 42 (apt-get)"


def probe(
    tmp_path: Path, env: dict[str, str], refusals: int, wait: int
) -> subprocess.CompletedProcess[str]:
    (tmp_path / "refusals").write_text(str(refusals))
    return make(
        "-f", "Makefile", "-f", str(tmp_path / "probe.mk"), "probe", f"APT_WAIT={wait}", env=env
    )


def test_apt_update_waits_for_another_apts_lock_then_installs(tmp_path: Path) -> None:
    env, log = stand_in_apt(tmp_path, HELD)
    result = probe(tmp_path, env, refusals=1, wait=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "another apt holds its lock: waiting (up to 60 s)" in result.stdout
    calls = log.read_text().splitlines()
    assert calls == [
        "-o DPkg::Lock::Timeout=60 update -qq",
        "-o DPkg::Lock::Timeout=60 update -qq",
        "-o DPkg::Lock::Timeout=60 install -y -qq probe-pkg",
    ]


def test_apt_gives_up_on_a_lock_held_past_the_wait(tmp_path: Path) -> None:
    env, log = stand_in_apt(tmp_path, HELD)
    result = probe(tmp_path, env, refusals=1000, wait=0)
    assert result.returncode != 0
    assert HELD in result.stderr
    assert "error: another apt held its lock for 0 s" in result.stderr
    assert "APT_WAIT" in result.stderr
    assert [c for c in log.read_text().splitlines() if "install" in c] == []


def test_apt_fails_at_once_on_any_other_error(tmp_path: Path) -> None:
    env, log = stand_in_apt(tmp_path, "E: The repository 'x' is not signed.")
    result = probe(tmp_path, env, refusals=1, wait=60)
    assert result.returncode != 0
    assert "is not signed" in result.stderr
    assert "waiting" not in result.stdout
    assert log.read_text().splitlines() == ["-o DPkg::Lock::Timeout=60 update -qq"]


def test_the_trace_targets_say_where_the_traces_come_from(tmp_path: Path) -> None:
    empty = tmp_path / "traces"
    empty.mkdir()
    for target in ("traces-check", "bench", "bench-packing", "bench-dra-packing"):
        # PYTHON=false: were the traces not checked first, making the virtualenv fails
        result = make(target, f"TRACES={empty}", f"VENV={tmp_path / 'venv'}", "PYTHON=false")
        assert result.returncode != 0, target
        (line,) = [x for x in result.stderr.splitlines() if not x.startswith("make")]
        assert line.startswith(f"error: no {empty}/openb_node_list_gpu_node.csv: "), line
        assert TRACE_SOURCE in line
        assert "'make traces' downloads them" in line
    for name in TRACE_FILES:
        (empty / name).write_text("sn\n")
    assert make("traces-check", f"TRACES={empty}").returncode == 0
    # files already there are not fetched again (this machine needs no network for it)
    result = make("traces", f"TRACES={empty}")
    assert result.returncode == 0, result.stderr
    assert [(empty / name).read_text() for name in TRACE_FILES] == ["sn\n"] * len(TRACE_FILES)

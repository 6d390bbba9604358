"""Running native/build/probe under the interposer, or with none, and reading its JSON lines.

The probe (native/tests/probe.c) runs the driver and NVML calls named on its
command line and prints one JSON object per command. Everything here builds its
environment the same way:

* ``LD_LIBRARY_PATH`` is the fake driver's directory (native/build/fake);
* ``LD_PRELOAD`` is the interposer of the chosen build: ``release`` is
  build/libgpuslice.so, ``asan`` is the sanitizer runtime followed by
  build/asan/libgpuslice.so, ``none`` preloads nothing (tests of the fake itself);
  libraries in ``preload_after`` come after it;
* ``GPUSLICE_CONTEXT_OVERHEAD=0`` unless the test says otherwise;
* inherited variables of the interposer, the fake, CUDA and the sanitizers are
  dropped, so the caller's shell cannot change a test; the test's own ``env``
  comes last (a ``None`` value removes a variable).

Any sanitizer report on stderr fails the test.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import queue
import subprocess
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

import pytest

Build = Literal["release", "asan", "none"]
Line = dict[str, Any]
EnvOverrides = Mapping[str, str | int | None]
# One word ("alloc"), several ("alloc 1m"), or a number given as such (1.5, 2000).
Command = str | int | float

ROOT = Path(__file__).resolve().parents[2]
NATIVE = ROOT / "native"

# Reports that fail a test wherever they appear on a probe's stderr.
SANITIZER_MARKERS = ("ERROR: AddressSanitizer", "runtime error:", "ERROR: LeakSanitizer")
ASAN_OPTIONS = "detect_leaks=0:abort_on_error=1"
UBSAN_OPTIONS = "halt_on_error=1:print_stacktrace=1"

# Inherited variables that would change what the interposer, the fake or the
# sanitizers do: dropped from every probe's environment.
_CONTROLLED_PREFIXES = ("GPUSLICE_", "FAKECUDA_", "FAKENVML_", "CUDA_", "LIBCUDA_", "NVIDIA_")
_CONTROLLED_NAMES = frozenset(
    {
        "ACTIVE_OOM_KILLER",
        "GPU_CORE_UTILIZATION_POLICY",
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
        "ASAN_OPTIONS",
        "UBSAN_OPTIONS",
        "LSAN_OPTIONS",
    }
)

MAKE_TIMEOUT_S = 900


@dataclass(frozen=True)
class Native:
    """Where the native build puts things (paths only; nothing is checked here)."""

    root: Path
    build: Path
    lib: Path
    asan_lib: Path
    fake_dir: Path
    probe: Path
    other_interposer: Path

    @classmethod
    def at(cls, root: Path = NATIVE) -> Native:
        build = root / "build"
        return cls(
            root=root,
            build=build,
            lib=build / "libgpuslice.so",
            asan_lib=build / "asan" / "libgpuslice.so",
            fake_dir=build / "fake",
            probe=build / "probe",
            other_interposer=build / "other_interposer.so",
        )


# ----------------------------------------------------------------------------- building


@functools.cache
def _make(root: Path, targets: tuple[str, ...]) -> tuple[int, str]:
    """`make -C root targets`, once per session (later calls return the first outcome)."""
    build = root / "build"
    build.mkdir(parents=True, exist_ok=True)
    # Serialise with any other pytest process building the same tree.
    with open(build / ".pytest-make.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            done = subprocess.run(
                ["make", "-C", str(root), *targets],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=MAKE_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            return 124, f"make timed out after {MAKE_TIMEOUT_S}s\n{_text(exc.output)}"
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return done.returncode, done.stdout


def ensure_built(native: Native, *targets: str) -> None:
    """Builds `targets` (once per session); fails the test with make's output if it fails."""
    rc, output = _make(native.root, tuple(targets))
    if rc != 0:
        pytest.fail(
            f"make -C {native.root} {' '.join(targets)} failed ({rc}):\n{output}", pytrace=False
        )


def targets_for(build: Build) -> tuple[str, ...]:
    """What a probe run of `build` needs: the fakes and test programs, plus the libraries."""
    return ("fakes", "progs") if build == "none" else ("check",)


def _ldd(path: Path) -> dict[str, str]:
    """soname -> resolved path of a library's dependencies ("" when ldd cannot find one)."""
    out = subprocess.run(
        ["ldd", str(path)], capture_output=True, text=True, check=False, timeout=60
    ).stdout
    deps: dict[str, str] = {}
    for raw in out.splitlines():
        name, sep, rest = raw.strip().partition(" => ")
        if sep:
            target = rest.split(" (")[0].strip()
            deps[name] = "" if target == "not found" else target
    return deps


def _cc_file(name: str) -> str:
    cc = os.environ.get("CC", "cc")
    out = subprocess.run(
        [cc, f"-print-file-name={name}"], capture_output=True, text=True, check=False, timeout=60
    ).stdout.strip()
    # cc echoes the bare name when it has no such file.
    return str(Path(out).resolve()) if os.path.isabs(out) and Path(out).exists() else ""


@functools.cache
def asan_runtime(asan_lib: Path) -> tuple[str, ...]:
    """The sanitizer runtimes to preload before the asan build: libasan first, then libubsan
    when the library needs it. The copies the library itself resolves are preferred, so the
    process never holds two of them."""
    deps = _ldd(asan_lib)
    found: list[str] = []
    for stem in ("libasan", "libubsan"):
        needed = {so: path for so, path in deps.items() if so.startswith(stem + ".so")}
        path = next((p for p in needed.values() if p), "")
        if not path and (stem == "libasan" or needed):
            path = _cc_file(stem + ".so")
        if path:
            found.append(path)
        elif stem == "libasan":
            pytest.fail(f"no libasan for {asan_lib} (ldd: {deps}); is the asan build linked?")
    return tuple(found)


# ----------------------------------------------------------------------------- environment


def _controlled(name: str) -> bool:
    return name in _CONTROLLED_NAMES or name.startswith(_CONTROLLED_PREFIXES)


def probe_env(
    native: Native,
    build: Build = "release",
    env: EnvOverrides | None = None,
    preload_after: Sequence[str | Path] = (),
) -> dict[str, str]:
    """The environment a probe of `build` runs in (see the module's docstring)."""
    out = {name: value for name, value in os.environ.items() if not _controlled(name)}
    out["LD_LIBRARY_PATH"] = str(native.fake_dir)
    preload: list[str] = []
    if build == "release":
        preload.append(str(native.lib))
    elif build == "asan":
        preload.extend(asan_runtime(native.asan_lib))
        preload.append(str(native.asan_lib))
        out["ASAN_OPTIONS"] = ASAN_OPTIONS
        out["UBSAN_OPTIONS"] = UBSAN_OPTIONS
    elif build != "none":
        raise ValueError(f"unknown build {build!r}")
    preload.extend(str(p) for p in preload_after)
    if preload:
        out["LD_PRELOAD"] = " ".join(preload)
    out["GPUSLICE_CONTEXT_OVERHEAD"] = "0"
    for name, value in (env or {}).items():
        if value is None:
            out.pop(name, None)
        else:
            out[name] = str(value)
    return out


def probe_argv(native: Native, commands: Iterable[Command], options: Sequence[str]) -> list[str]:
    """The probe's command line; each command may be one word or several ("alloc 1m")."""
    words = [w for command in commands for w in str(command).split()]
    return [str(native.probe), *options, *words]


# ----------------------------------------------------------------------------- results


def _text(data: str | bytes | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def check_sanitizers(stderr: str, what: str = "probe") -> None:
    """Fails the test when a sanitizer reported anything."""
    if any(marker in stderr for marker in SANITIZER_MARKERS):
        pytest.fail(f"sanitizer report from {what}:\n{stderr}", pytrace=False)


def parse_lines(stdout: str) -> tuple[list[Line], list[str]]:
    """The probe's JSON objects, and any other stdout lines (kept for messages)."""
    lines: list[Line] = []
    noise: list[str] = []
    for raw in stdout.splitlines():
        parsed = _parse(raw)
        if parsed is None:
            if raw.strip():
                noise.append(raw)
        else:
            lines.append(parsed)
    return lines, noise


def _parse(raw: str) -> Line | None:
    text = raw.strip()
    if not text.startswith("{"):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


@dataclass
class ProbeResult:
    """One finished probe: its JSON lines in order, stderr and exit status."""

    argv: list[str]
    returncode: int
    stderr: str
    lines: list[Line]
    noise: list[str] = field(default_factory=list)

    def by_cmd(self, name: str) -> list[Line]:
        """Every line of command `name`, in order."""
        return [line for line in self.lines if line.get("cmd") == name]

    def one(self, name: str) -> Line:
        """The only line of command `name` (fails unless there is exactly one)."""
        found = self.by_cmd(name)
        assert len(found) == 1, f"expected one {name!r} line, got {len(found)}\n{self.describe()}"
        return found[0]

    def last(self, name: str) -> Line:
        found = self.by_cmd(name)
        assert found, f"no {name!r} line\n{self.describe()}"
        return found[-1]

    def __getitem__(self, index: int) -> Line:
        return self.lines[index]

    def __len__(self) -> int:
        return len(self.lines)

    def rcs(self) -> list[int]:
        """The rc of every line, in order."""
        return [int(line.get("rc", -1)) for line in self.lines]

    def describe(self) -> str:
        """The run, for assertion messages."""
        shown = "\n".join(json.dumps(line) for line in self.lines)
        extra = "\n".join(self.noise)
        return (
            f"$ {' '.join(self.argv)}\nexit {self.returncode}\n--- stdout\n{shown}\n{extra}"
            f"\n--- stderr\n{self.stderr}"
        )


def finish(argv: list[str], returncode: int, stdout: str, stderr: str, check: bool) -> ProbeResult:
    lines, noise = parse_lines(stdout)
    result = ProbeResult(argv=argv, returncode=returncode, stderr=stderr, lines=lines, noise=noise)
    check_sanitizers(stderr, " ".join(argv))
    if check and returncode != 0:
        pytest.fail(f"probe exited {returncode}\n{result.describe()}", pytrace=False)
    return result


def run(
    native: Native,
    *commands: Command,
    env: EnvOverrides | None = None,
    build: Build = "release",
    options: Sequence[str] = (),
    timeout: float = 30,
    check: bool = True,
    preload_after: Sequence[str | Path] = (),
    prefix: Sequence[str] = (),
) -> ProbeResult:
    """Runs the probe to completion. With `check`, a non-zero exit fails the test.
    `prefix` runs before it and execs it (a launcher such as tests/native/container.py's)."""
    argv = [*prefix, *probe_argv(native, commands, options)]
    try:
        done = subprocess.run(
            argv,
            env=probe_env(native, build, env, preload_after),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        lines, _ = parse_lines(_text(exc.output))
        shown = "\n".join(json.dumps(line) for line in lines)
        pytest.fail(
            f"probe timed out after {timeout}s: {' '.join(argv)}\n--- stdout\n{shown}"
            f"\n--- stderr\n{_text(exc.stderr)}",
            pytrace=False,
        )
    return finish(argv, done.returncode, done.stdout, done.stderr, check)


# ----------------------------------------------------------------------------- processes


class ProbeProcess(subprocess.Popen[str]):
    """A probe running in the background (a subprocess.Popen) whose JSON lines can be
    awaited one by one: `next_line`, `wait_for`; `result` waits for its end."""

    def __init__(self, argv: list[str], env: dict[str, str], stderr_path: Path) -> None:
        self.argv = argv
        self.stderr_path = stderr_path
        self.lines: list[Line] = []
        self.noise: list[str] = []
        self._queue: queue.Queue[Line | None] = queue.Queue()
        with open(stderr_path, "w") as err:
            super().__init__(
                argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                text=True,
            )  # fmt: skip
        self._reader = threading.Thread(target=self._read, name=f"probe-{self.pid}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        out: IO[str] | None = self.stdout
        try:
            if out is not None:
                for raw in out:
                    parsed = _parse(raw)
                    if parsed is None:
                        if raw.strip():
                            self.noise.append(raw.rstrip("\n"))
                        continue
                    self.lines.append(parsed)
                    self._queue.put(parsed)
        except (OSError, ValueError):
            pass
        finally:
            self._queue.put(None)

    def stderr_text(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def describe(self) -> str:
        shown = "\n".join(json.dumps(line) for line in self.lines)
        return (
            f"$ {' '.join(self.argv)}\nexit {self.returncode}\n--- stdout\n{shown}\n"
            + "\n".join(self.noise)
            + f"\n--- stderr\n{self.stderr_text()}"
        )

    def next_line(self, timeout: float = 10) -> Line:
        """The next JSON line; fails the test when none comes within `timeout` or the probe
        ended."""
        try:
            line = self._queue.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"no line from probe {self.pid} in {timeout}s\n{self.describe()}")
        if line is None:
            self._queue.put(None)  # stay at the end for later calls
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.wait(timeout=max(timeout, 5.0))
            check_sanitizers(self.stderr_text(), " ".join(self.argv))
            pytest.fail(f"probe {self.pid} ended before the next line\n{self.describe()}")
        return line

    def wait_for(self, cmd: str, timeout: float = 10) -> Line:
        """Reads lines until one of command `cmd` comes (within `timeout` in all)."""
        deadline = time.monotonic() + timeout
        while True:
            line = self.next_line(timeout=max(0.0, deadline - time.monotonic()))
            if line.get("cmd") == cmd:
                return line

    def stop(self) -> None:
        """SIGKILLs the probe if it still runs, and reaps it."""
        if self.poll() is None:
            self.kill()
        self.wait()
        self._reader.join(timeout=10)
        if self.stdout is not None:
            self.stdout.close()

    def result(self, timeout: float = 30, check: bool = True) -> ProbeResult:
        """Waits for the probe to exit by itself; its result (sanitizers checked)."""
        try:
            self.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"probe {self.pid} still ran after {timeout}s\n{self.describe()}")
        self._reader.join(timeout=10)
        if self.stdout is not None:
            self.stdout.close()
        result = ProbeResult(
            argv=self.argv,
            returncode=self.returncode,
            stderr=self.stderr_text(),
            lines=list(self.lines),
            noise=list(self.noise),
        )
        check_sanitizers(result.stderr, " ".join(self.argv))
        if check and self.returncode != 0:
            pytest.fail(f"probe exited {self.returncode}\n{result.describe()}", pytrace=False)
        return result


class ProbeSpawner:
    """Starts background probes for one test and stops whatever is left at its end."""

    def __init__(self, native: Native, directory: Path) -> None:
        self.native = native
        self.directory = directory
        self.started: list[ProbeProcess] = []

    def __call__(
        self,
        *commands: Command,
        env: EnvOverrides | None = None,
        build: Build = "release",
        options: Sequence[str] = (),
        preload_after: Sequence[str | Path] = (),
        prefix: Sequence[str] = (),
    ) -> ProbeProcess:
        ensure_built(self.native, *targets_for(build))
        argv = [*prefix, *probe_argv(self.native, commands, options)]
        stderr_path = self.directory / f"probe-{len(self.started)}.stderr"
        proc = ProbeProcess(argv, probe_env(self.native, build, env, preload_after), stderr_path)
        self.started.append(proc)
        return proc

    def close(self) -> None:
        """Kills and reaps every probe still running; fails on any sanitizer report."""
        for proc in self.started:
            proc.stop()
        for proc in self.started:
            check_sanitizers(proc.stderr_text(), " ".join(proc.argv))


class ProbeRunner:
    """`run_probe(*commands, env=..., build=..., options=..., timeout=..., check=...)`."""

    def __init__(self, native: Native) -> None:
        self.native = native

    def __call__(
        self,
        *commands: Command,
        env: EnvOverrides | None = None,
        build: Build = "release",
        options: Sequence[str] = (),
        timeout: float = 30,
        check: bool = True,
        preload_after: Sequence[str | Path] = (),
        prefix: Sequence[str] = (),
    ) -> ProbeResult:
        ensure_built(self.native, *targets_for(build))
        return run(
            self.native,
            *commands,
            env=env,
            build=build,
            options=options,
            timeout=timeout,
            check=check,
            preload_after=preload_after,
            prefix=prefix,
        )


def race_start(delay_s: float = 1.0) -> int:
    """A CLOCK_REALTIME instant `delay_s` from now, in ns: the START_NS of `race`."""
    return time.time_ns() + int(delay_s * 1e9)


def limited(region: Path, limit: str = "1g", **extra: str | int) -> dict[str, str | int]:
    """The environment of a container with a memory limit and a shared region."""
    return {
        "CUDA_DEVICE_MEMORY_LIMIT": limit,
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(region),
        **extra,
    }

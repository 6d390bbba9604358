"""What every part of the kit's runner shares: constants, argument parsers,
JSON-line parsing, named checks and the libraries a run compares."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

MiB = 1024 * 1024
SECTIONS = (
    "environment",
    "allocation",
    "lookup",
    "nvml",
    "pytorch",
    "workloads",
    "compute",
    "agent_view",
    "overhead",
)
# Sections measured once per library (gpuslice, then each --peer); the others
# check gpuslice's own promises (its lookups, its NVML hooks).
PER_LIBRARY = ("allocation", "pytorch", "workloads", "compute", "agent_view", "overhead")
ALLOC_PATHS = (
    "cuMemAlloc_v2",
    "cuMemAllocPitch_v2",
    "cuMemAllocManaged",
    "cuArrayCreate_v2",
    "cuArray3DCreate_v2",
    "cuMipmappedArrayCreate",
    "cuMemCreate",
    "cuMemAllocAsync",
    "cuMemAllocFromPoolAsync",
)
POOL_PATHS = ("cuMemAllocAsync", "cuMemAllocFromPoolAsync")
ARRAY_PATHS = ("cuArrayCreate_v2", "cuArray3DCreate_v2", "cuMipmappedArrayCreate")
CUDA_ERROR_OUT_OF_MEMORY = 2
# Settings of the interposer (and of its deployment) that must not leak into
# the kit's runs from the calling environment.
SCRUB_EXACT = (
    "LD_PRELOAD",
    "GPU_CORE_UTILIZATION_POLICY",
    "CUDA_DEVICE_MEMORY_SHARED_CACHE",
    "LIBCUDA_LOG_LEVEL",
    "CUDA_DISABLE_CONTROL",
    "CUDA_TASK_PRIORITY",
    "ACTIVE_OOM_KILLER",
    "PYTORCH_CUDA_ALLOC_CONF",
)
SCRUB_PREFIX = ("CUDA_DEVICE_MEMORY_LIMIT", "CUDA_DEVICE_SM_LIMIT", "GPUSLICE_")
PEER_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789_-")
RESERVED_NAMES = ("none", "gpuslice")


@dataclass(frozen=True)
class Lib:
    """A library the kit preloads: gpuslice's (`ours`) or a peer's."""

    name: str
    path: str
    ours: bool
    note: str | None = None


# --------------------------------------------------------------------------- parsers
def parse_size(text: str) -> int:
    t = text.strip().lower().rstrip("b").rstrip("i")
    mul = 1
    if t and t[-1] in "kmgt":
        mul = 1024 ** ("kmgt".index(t[-1]) + 1)
        t = t[:-1]
    try:
        v = float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4g, 300m, 4096)") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"negative size: {text!r}")
    return int(v * mul + 0.5)


def parse_int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of integers: {text!r}"
        ) from None


def parse_sections(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in SECTIONS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown section(s) {bad}; known: {', '.join(SECTIONS)}")
    return names


def parse_named(text: str) -> tuple[str, str]:
    """NAME=VALUE of --peer / --peer-note; NAME is lower-case letters, digits, - and _."""
    name, sep, value = text.partition("=")
    name = name.strip()
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    if not set(name) <= PEER_NAME_CHARS or len(name) > 32:
        raise argparse.ArgumentTypeError(
            f"peer name {name!r}: use at most 32 of a-z, 0-9, '-' and '_'"
        )
    if name in RESERVED_NAMES:
        raise argparse.ArgumentTypeError(f"peer name {name!r} is reserved")
    return name, value


# --------------------------------------------------------------------------- helpers
def mib(v) -> str:
    return "?" if v is None else f"{v / MiB:.0f} MiB"


def env_size(v: int) -> str:
    """A byte count as the interposers' environment takes it (MiB when whole)."""
    return f"{v // MiB}m" if v % MiB == 0 else str(v)


def tail(text: str, n: int = 3000) -> str:
    return text if len(text) <= n else "..." + text[-n:]


def dig(d, *keys, default=None):
    for k in keys:
        in_dict = isinstance(d, dict) and k in d
        in_list = isinstance(d, list) and isinstance(k, int) and -len(d) <= k < len(d)
        if in_dict or in_list:
            d = d[k]
        else:
            return default
    return d


def parse_json_lines(text: str):
    """Every JSON object line; the last {"event":"result"} is the result."""
    events, other, result = [], [], None
    for line in text.splitlines():
        s = line.strip()
        if not s:
            continue
        if s.startswith("{"):
            try:
                obj = json.loads(s)
            except ValueError:
                other.append(s)
                continue
            events.append(obj)
            if obj.get("event") == "result":
                result = obj
        else:
            other.append(s)
    return events, other, result


def median(values):
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    n = len(vals)
    return vals[n // 2] if n % 2 else (vals[n // 2 - 1] + vals[n // 2]) / 2


class Checks:
    """Named checks: required ones decide pass/fail, the others are warnings."""

    def __init__(self) -> None:
        self.items: list[dict] = []

    def add(self, name: str, ok, required: bool = True, **detail) -> bool:
        item = {"name": name, "ok": bool(ok), "required": required}
        item.update(detail)
        self.items.append(item)
        return bool(ok)

    def status(self) -> str:
        if any(not c["ok"] and c["required"] for c in self.items):
            return "fail"
        return "pass"

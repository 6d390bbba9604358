"""The fake NVML's MIG calls answer as NVML does: what the device plugin's MIG tests
stand on. Each case runs pynvml in a process of its own (NVML loads once)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.native.probe import Native, probe_env

SCRIPT = r"""
import ctypes, json, sys
import pynvml as n

def code(call, *args):
    try:
        call(*args)
    except n.NVMLError as exc:
        return exc.value
    return 0

n.nvmlInit()
card, plain = n.nvmlDeviceGetHandleByIndex(0), n.nvmlDeviceGetHandleByIndex(1)
# the fake, never a real card: this script makes and destroys instances
assert n.nvmlDeviceGetUUID(card).startswith("GPU-facefeed-"), "not the fake NVML"
out = {"plain": code(n.nvmlDeviceCreateGpuInstance, plain, 2)}  # MIG off
place = lambda s, z: ctypes.byref(n.c_nvmlGpuInstancePlacement_t(s, z))
out["bad_placement"] = code(n.nvmlDeviceCreateGpuInstanceWithPlacement, card, 2, place(2, 4))
gi = n.nvmlDeviceCreateGpuInstanceWithPlacement(card, 2, place(4, 4))
out["overlap"] = code(n.nvmlDeviceCreateGpuInstanceWithPlacement, card, 1, place(4, 2))
ci = n.nvmlGpuInstanceCreateComputeInstance(gi, 2)
out["second_ci"] = code(n.nvmlGpuInstanceCreateComputeInstance, gi, 2)
out["gi_with_ci"] = code(n.nvmlGpuInstanceDestroy, gi)
mig = n.nvmlDeviceGetMigDeviceHandleByIndex(card, 0)
out["mig"] = [
    n.nvmlDeviceGetUUID(mig),
    n.nvmlDeviceGetMemoryInfo(mig).total >> 20,
    n.nvmlDeviceGetUUID(n.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)),
    n.nvmlDeviceGetGpuInstanceId(mig),
    n.nvmlDeviceIsMigDeviceHandle(mig).value,
    n.nvmlDeviceIsMigDeviceHandle(card).value,
]
out["second_index"] = code(n.nvmlDeviceGetMigDeviceHandleByIndex, card, 1)
out["state"] = open(sys.argv[1]).read()
n.nvmlComputeInstanceDestroy(ci)
n.nvmlGpuInstanceDestroy(gi)
out["stale_handle"] = code(n.nvmlGpuInstanceGetInfo, gi)
out["after"] = open(sys.argv[1]).read()
print(json.dumps(out))
"""


def run(native: Native, state: Path) -> dict[str, Any]:
    env = probe_env(
        native,
        "none",
        {
            "FAKECUDA_DEVICES": "2",
            "FAKECUDA_MEMORY": "40g",
            "FAKENVML_MIG": "1,0",
            "FAKENVML_MIG_FILE": str(state),
        },
    )
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(state)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_mig_calls_answer_with_nvml_s_codes(native_tools: Native, tmp_path: Path) -> None:
    out = run(native_tools, tmp_path / "mig")
    # NVML_ERROR_NOT_SUPPORTED, INVALID_ARGUMENT, INSUFFICIENT_RESOURCES, IN_USE
    assert out["plain"] == 3
    assert out["bad_placement"] == 2
    assert out["overlap"] == 23
    assert out["second_ci"] == 23
    assert out["gi_with_ci"] == 19
    uuid, memory, parent, gi_id, is_mig, card_is_mig = out["mig"]
    assert uuid.startswith("MIG-")
    assert len(uuid) == 40
    assert (memory, parent, gi_id, is_mig, card_is_mig) == (
        19968,
        "GPU-facefeed-0000-4000-8000-000000000000",
        1,
        1,
        0,
    )
    assert out["second_index"] == 6  # NOT_FOUND
    assert out["state"] == f"serial 1\ngi 0 1 2 4 0 {uuid}\n"
    assert out["stale_handle"] == 6
    assert out["after"] == "serial 1\n"


def test_instances_outlive_the_process(native_tools: Native, tmp_path: Path) -> None:
    state = tmp_path / "mig"
    first = run(native_tools, state)
    second = run(native_tools, state)  # a later process makes a new, different device
    assert second["mig"][0] != first["mig"][0]
    assert second["after"] == "serial 2\n"

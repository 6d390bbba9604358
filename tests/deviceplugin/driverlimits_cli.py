"""Runs gpuslice_deviceplugin.driverlimits in a process of its own (NVML loads once
per process) against whatever libnvidia-ml.so.1 LD_LIBRARY_PATH finds; prints JSON.

usage: python driverlimits_cli.py support
       python driverlimits_cli.py ensure INDEX CGROUP HARD_BYTES
       python driverlimits_cli.py read INDEX CGROUP
       python driverlimits_cli.py write INDEX CGROUP SOFT HARD   (prints NVML's return code)
"""

from __future__ import annotations

import dataclasses
import json
import sys

import pynvml  # type: ignore[import-untyped]

from gpuslice_common.models import GpuDevice
from gpuslice_deviceplugin import driverlimits


def main(argv: list[str]) -> int:
    pynvml.nvmlInit()
    try:
        if argv[1] == "support":
            devices = []
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                uuid = str(pynvml.nvmlDeviceGetUUID(handle))
                devices.append(GpuDevice(uuid=uuid, index=index, model="m", memory_mib=1))
            found = driverlimits.card_support(devices)
            print(json.dumps({u: dataclasses.asdict(s) for u, s in found.items()}))
        elif argv[1] == "ensure":
            result = driverlimits.ensure_limit(int(argv[2]), argv[3], int(argv[4]))
            print(json.dumps(dataclasses.asdict(result)))
        elif argv[1] == "read":
            root = driverlimits.cgroup2_root()
            assert root is not None
            got = driverlimits.read_limits(int(argv[2]), driverlimits.group_path(root, argv[3]))
            print(json.dumps(got if isinstance(got, int) else dataclasses.asdict(got)))
        elif argv[1] == "write":
            root = driverlimits.cgroup2_root()
            assert root is not None
            path = driverlimits.group_path(root, argv[3])
            print(driverlimits.write_limits(int(argv[2]), path, int(argv[4]), int(argv[5])))
        else:
            print(__doc__, file=sys.stderr)
            return 2
    finally:
        pynvml.nvmlShutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

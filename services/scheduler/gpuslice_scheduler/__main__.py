"""``python -m gpuslice_scheduler``: run the extender with settings from GPUSLICE_* variables."""

from __future__ import annotations

import sys

from gpuslice_common.bus import BusError
from gpuslice_common.config import SchedulerSettings
from gpuslice_common.devicetypes import DeviceConfigError
from gpuslice_common.kube import KubeError
from gpuslice_common.service import run_service
from gpuslice_scheduler.core import CoreError
from gpuslice_scheduler.service import main


def run() -> int:
    return run_service(
        "gpuslice-scheduler",
        SchedulerSettings,
        main,
        fatal=(BusError, KubeError, OSError, CoreError, DeviceConfigError),
    )


if __name__ == "__main__":
    sys.exit(run())

"""``python -m gpuslice_scheduler``: run the extender with settings from GPUSLICE_* variables."""

from __future__ import annotations

import asyncio
import logging
import sys

from gpuslice_common.bus import BusError
from gpuslice_common.config import ConfigError, SchedulerSettings, load
from gpuslice_common.kube import KubeError
from gpuslice_scheduler.service import main


def run() -> int:
    try:
        settings = load(SchedulerSettings)
    except ConfigError as exc:
        print(f"gpuslice-scheduler: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        asyncio.run(main(settings))
    except (BusError, KubeError, OSError) as exc:
        print(f"gpuslice-scheduler: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(run())

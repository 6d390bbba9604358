"""``python -m gpuslice_scheduler``: run the extender with settings from GPUSLICE_* variables."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Coroutine
from typing import Any

from gpuslice_common.bus import BusError
from gpuslice_common.config import ConfigError, SchedulerSettings, load
from gpuslice_common.kube import KubeError
from gpuslice_scheduler.service import main


def run_loop(coroutine: Coroutine[Any, Any, None]) -> None:
    """Run on uvloop where it is installed (it is a dependency off Windows)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coroutine)
    else:
        uvloop.run(coroutine)


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
        run_loop(main(settings))
    except (BusError, KubeError, OSError) as exc:
        print(f"gpuslice-scheduler: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(run())

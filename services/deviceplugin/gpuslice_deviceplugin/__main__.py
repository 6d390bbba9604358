"""``python -m gpuslice_deviceplugin``: the node agent, with settings from GPUSLICE_* variables."""

from __future__ import annotations

import asyncio
import logging
import sys

from gpuslice_common.bus import BusError
from gpuslice_common.config import ConfigError, DevicePluginSettings, load
from gpuslice_common.kube import KubeError
from gpuslice_deviceplugin.containers import InstallError
from gpuslice_deviceplugin.discovery import DiscoveryError
from gpuslice_deviceplugin.kubelet import KubeletLinkError
from gpuslice_deviceplugin.nodeconfig import NodeConfigError
from gpuslice_deviceplugin.service import main

NAME = "gpuslice-deviceplugin"


def run() -> int:
    try:
        settings = load(DevicePluginSettings)
    except ConfigError as exc:
        print(f"{NAME}: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        asyncio.run(main(settings))
    except (NodeConfigError, InstallError) as exc:
        print(f"{NAME}: {exc}", file=sys.stderr)
        return 2
    except (BusError, KubeError, DiscoveryError, KubeletLinkError, OSError) as exc:
        print(f"{NAME}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(run())

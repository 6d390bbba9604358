"""``python -m gpuslice_deviceplugin``: the node agent, with settings from GPUSLICE_* variables."""

from __future__ import annotations

import sys

from gpuslice_common.bus import BusError
from gpuslice_common.config import ConfigError, DevicePluginSettings
from gpuslice_common.kube import KubeError
from gpuslice_common.service import run_service
from gpuslice_deviceplugin.containers import InstallError
from gpuslice_deviceplugin.discovery import DiscoveryError
from gpuslice_deviceplugin.kubelet import KubeletLinkError
from gpuslice_deviceplugin.nodeconfig import NodeConfigError
from gpuslice_deviceplugin.service import main


def run() -> int:
    return run_service(
        "gpuslice-deviceplugin",
        DevicePluginSettings,
        main,
        fatal=(ConfigError, NodeConfigError, InstallError),
        failed=(BusError, KubeError, DiscoveryError, KubeletLinkError, OSError),
        uvloop=False,  # grpc.aio runs on asyncio's own loop
    )


if __name__ == "__main__":
    sys.exit(run())

"""``python -m gpuslice_inventory``: run the inventory with settings from GPUSLICE_* variables."""

from __future__ import annotations

import sys

from gpuslice_common.bus import BusError
from gpuslice_common.config import InventorySettings
from gpuslice_common.devicetypes import DeviceConfigError
from gpuslice_common.kube import KubeError
from gpuslice_common.ledger import LedgerError
from gpuslice_common.service import run_service
from gpuslice_inventory.service import main


def run() -> int:
    return run_service(
        "gpuslice-inventory",
        InventorySettings,
        main,
        fatal=(KubeError, DeviceConfigError),
        failed=(BusError, LedgerError, OSError),
    )


if __name__ == "__main__":
    sys.exit(run())

"""``python -m gpuslice_webhook``: run the webhook with settings from GPUSLICE_* variables."""

from __future__ import annotations

import sys

from gpuslice_common.config import WebhookSettings
from gpuslice_common.devicetypes import DeviceConfigError
from gpuslice_common.kube import KubeError
from gpuslice_common.service import run_service
from gpuslice_webhook.service import main
from gpuslice_webhook.tls import TlsError


def run() -> int:
    return run_service(
        "gpuslice-webhook",
        WebhookSettings,
        main,
        fatal=(KubeError, TlsError, OSError, DeviceConfigError),
    )


if __name__ == "__main__":
    sys.exit(run())

"""``python -m gpuslice_webhook``: run the webhook with settings from GPUSLICE_* variables."""

from __future__ import annotations

import asyncio
import logging
import sys

from gpuslice_common.config import ConfigError, WebhookSettings, load
from gpuslice_common.kube import KubeError
from gpuslice_webhook.service import main
from gpuslice_webhook.tls import TlsError


def run() -> int:
    try:
        settings = load(WebhookSettings)
    except ConfigError as exc:
        print(f"gpuslice-webhook: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        try:
            import uvloop
        except ImportError:
            asyncio.run(main(settings))
        else:
            uvloop.run(main(settings))
    except (KubeError, TlsError, OSError) as exc:
        print(f"gpuslice-webhook: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(run())

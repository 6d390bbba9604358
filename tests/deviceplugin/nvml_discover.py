"""Discovers GPUs in a process of its own (NVML loads once per process) and prints JSON.

usage: python nvml_discover.py KIND NODE [CONFIG_FILE]

Opens the backend KIND (auto, nvml or simulated) and prints one line,
``{"backend": ..., "devices": [...]}`` (or ``{"error": ...}``), then another
after each line read from stdin; at the end of stdin it closes the backend.
Logs go to stderr at DEBUG level.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any, Literal, cast, get_args

from gpuslice_deviceplugin.discovery import Backend, DiscoveryError, open_backend
from gpuslice_deviceplugin.nodeconfig import load_node_config

Kind = Literal["auto", "nvml", "simulated"]


def report(backend: Backend) -> dict[str, Any]:
    try:
        devices = backend.devices()
    except DiscoveryError as exc:
        return {"backend": backend.name, "error": str(exc)}
    return {"backend": backend.name, "devices": [d.model_dump(mode="json") for d in devices]}


def main(argv: list[str]) -> int:
    logging.basicConfig(
        level=logging.DEBUG, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    if len(argv) not in (3, 4) or argv[1] not in get_args(Kind):
        print(__doc__, file=sys.stderr)
        return 2
    kind, node = cast(Kind, argv[1]), argv[2]
    config = load_node_config(argv[3] if len(argv) > 3 else None, node)
    try:
        backend = open_backend(kind, node, config)
    except DiscoveryError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 1
    try:
        while True:
            print(json.dumps(report(backend)), flush=True)
            if not sys.stdin.readline():
                return 0
    finally:
        backend.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv))

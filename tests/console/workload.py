"""What the console's browser tests run on the local stack, and the browser.

The pods run the probe under the interposer on the fake CUDA driver; a pod
that must keep running waits in the probe's ``lock PATH`` on a :class:`Gate`
the test holds, and goes on when the test opens it.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import shlex
import shutil
from pathlib import Path
from typing import Any

from playwright.async_api import ViewportSize

from gpuslice_cli.dev.stack import Stack
from gpuslice_common.ledger import Ledger
from gpuslice_common.models import PlacementState

WAIT_MS = 60_000  # a busy machine is slow: generous waits, never a fixed sleep
DESKTOP: ViewportSize = {"width": 1280, "height": 800}
PHONE: ViewportSize = {"width": 390, "height": 844}


def chromium() -> tuple[str, list[str]]:
    """Debian's chromium and its arguments; the tests never download a browser
    (``make test`` installs the system's). Root cannot use chromium's sandbox."""
    found = shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"
    assert Path(found).exists(), "chromium is not installed: `make test` installs Debian's"
    return found, ["--no-sandbox"] if os.geteuid() == 0 else []


class Gate:
    """A file this process holds a POSIX lock on: a probe's ``lock PATH`` waits
    on it (its lock is an OFD lock, which a POSIX lock blocks) until ``open()``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.touch()
        self._fd: int | None = os.open(path, os.O_RDWR)
        fcntl.lockf(self._fd, fcntl.LOCK_EX)

    def open(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the lock
            self._fd = None


def on_its_card(*commands: str) -> list[str]:
    """The probe on the container's own card: the fake driver shows every card of
    the node, so the shell finds the granted UUID's index among them (a container
    on a real node sees only its own card, as device 0)."""
    script = (
        'i=0; for u in $(echo "$FAKECUDA_UUIDS" | tr , " "); do '
        '[ "$u" = "$NVIDIA_VISIBLE_DEVICES" ] && break; i=$((i + 1)); done; '
        f'exec probe init ctx "$i" {shlex.join(commands)}'
    )
    return ["sh", "-c", script]


def gpu_pod(
    name: str, command: list[str], annotations: dict[str, str] | None = None, **limits: int
) -> dict[str, Any]:
    """A one-container pod asking one card, with ``gpumem=``, ``gpucores=``..."""
    resources = {"nvidia.com/gpu": 1} | {f"nvidia.com/{k}": v for k, v in limits.items()}
    return {
        "metadata": {"name": name, "annotations": annotations or {}},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": "cuda",
                    "command": command,
                    "resources": {"limits": resources},
                }
            ]
        },
    }


async def card_of(stack: Stack, ledger: Ledger, namespace: str, name: str) -> str:
    """The card the ledger says a running pod holds (asked until it has one)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_MS / 1000
    while True:
        for node in stack.nodes:
            for placement in await ledger.node_placements(node.name):
                pod = placement.pod
                live = placement.state is not PlacementState.RELEASED
                if live and (pod.namespace, pod.name) == (namespace, name):
                    return placement.containers[0].devices[0].uuid
        assert loop.time() < deadline, f"{namespace}/{name} got no card"
        await asyncio.sleep(0.2)

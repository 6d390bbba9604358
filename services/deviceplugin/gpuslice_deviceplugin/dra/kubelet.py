"""kubelet's side of DRA for the agent: the DRA plugin gRPC service and the
plugin registration kubelet's plugin watcher finds."""

from __future__ import annotations

from pathlib import Path

from gpuslice_common.dra import DRIVER
from gpuslice_deviceplugin.dra.contract import ClaimPreparer


class DraPluginServer:
    """Serves ``v1.DRAPlugin`` on ``<plugins_dir>/<driver>/dra.sock`` for ``preparer``
    and the registration on ``<registry_dir>/<driver>-reg.sock``."""

    def __init__(
        self,
        preparer: ClaimPreparer,
        plugins_dir: Path,
        registry_dir: Path,
        driver: str = DRIVER,
    ) -> None:
        self.preparer = preparer
        self.plugins_dir = plugins_dir
        self.registry_dir = registry_dir
        self.driver = driver

    async def start(self) -> None:
        """Serve both sockets (replacing stale files); returns once they listen."""
        raise NotImplementedError

    async def stop(self, grace: float = 1.0) -> None:
        """Stop serving and remove both sockets."""
        raise NotImplementedError

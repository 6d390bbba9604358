"""HTTPS from mounted certificate and key files, reloaded when they change.

The server keeps one :class:`ssl.SSLContext` for its whole life. When either
file changes (a Secret update swaps the files behind a symlink, cert-manager
renews one), both are read, checked as a pair in a scratch context, and only
then loaded into the live context: new connections get the new certificate,
open ones keep theirs, and a half-written or mismatched pair is refused with a
log line while the old certificate stays in service. The bytes checked are the
bytes loaded, so a file changing in between cannot slip through.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


class TlsError(Exception):
    """The certificate or key cannot be used; the message names the file and why."""


@dataclass
class TlsStats:
    reloads: int = 0
    failures: int = 0
    last_error: str = ""


def _signature(path: Path) -> tuple[int, int, int, int]:
    st = path.stat()  # follows the symlinks a mounted Secret uses
    return (st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev)


def _server_context() -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


class ReloadingTls:
    """The live server context for ``cert_file`` and ``key_file``, kept current."""

    def __init__(self, cert_file: str | Path, key_file: str | Path) -> None:
        self.cert_file = Path(cert_file)
        self.key_file = Path(key_file)
        self.stats = TlsStats()
        self.context = _server_context()
        self._seen = self._signatures()
        self._load(self.context)

    def _signatures(self) -> tuple[tuple[int, int, int, int], ...]:
        try:
            return (_signature(self.cert_file), _signature(self.key_file))
        except OSError as exc:
            raise TlsError(f"cannot read {exc.filename}: {exc.strerror}") from None

    def _load(self, live: ssl.SSLContext) -> None:
        """Check the files as a pair, then load those same bytes into ``live``."""
        try:
            cert, key = self.cert_file.read_bytes(), self.key_file.read_bytes()
        except OSError as exc:
            raise TlsError(f"cannot read {exc.filename}: {exc.strerror}") from None
        with tempfile.TemporaryDirectory(prefix="gpuslice-tls-") as scratch:
            cert_copy, key_copy = Path(scratch, "tls.crt"), Path(scratch, "tls.key")
            for path, data in ((cert_copy, cert), (key_copy, key)):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as out:
                    out.write(data)
            try:
                _server_context().load_cert_chain(cert_copy, key_copy)
            except (ssl.SSLError, ValueError) as exc:
                raise TlsError(
                    f"{self.cert_file} and {self.key_file} are not a usable certificate "
                    f"and key: {exc}"
                ) from None
            live.load_cert_chain(cert_copy, key_copy)

    def reload_if_changed(self) -> bool:
        """Load the files again if they changed since last time; True when reloaded.

        A pair that cannot be used is logged and counted; the old one stays.
        """
        try:
            now = self._signatures()
        except TlsError as exc:
            self._failed(str(exc))
            return False
        if now == self._seen:
            return False
        self._seen = now
        try:
            self._load(self.context)
        except TlsError as exc:
            self._failed(str(exc))
            return False
        self.stats.reloads += 1
        log.info("loaded the renewed certificate %s", self.cert_file)
        return True

    def _failed(self, message: str) -> None:
        if message != self.stats.last_error:
            log.error("keeping the current certificate: %s", message)
        self.stats.failures += 1
        self.stats.last_error = message

    async def watch(self, interval: float) -> None:
        """Check the files every ``interval`` seconds until cancelled.

        The check runs on the event loop's own thread (two small reads), so the
        live context never changes while the loop is making a connection from it.
        """
        while True:
            await asyncio.sleep(interval)
            self.reload_if_changed()

"""HTTPS from mounted certificate and key files, reloaded when they change.

uvicorn holds one :class:`ssl.SSLContext` for the server's life. Its SNI callback,
called on every handshake (with or without a server name), hands the handshake
to the newest good context. When either file changes (a Secret update swaps the
files behind a symlink, cert-manager renews one), both are read and a fresh
context is built from those bytes; only if the pair loads does it become the
newest. New connections get the new certificate, open ones keep theirs, and a
half-written or mismatched pair is logged and counted while the old certificate
stays in service. A fresh context per reload means nothing of the old pair
lingers (OpenSSL keeps one certificate per key type in a context). The key is
handed to OpenSSL through an anonymous in-memory file where Linux offers one,
so it is never written to disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import tempfile
from collections.abc import Iterator
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


# TLS 1.2 suites: forward secret (ECDHE) and authenticated encryption (AES-GCM,
# ChaCha20-Poly1305) only; OpenSSL's default list also has CBC suites. TLS 1.3's
# suites (all AEAD) are not set by this list and stay OpenSSL's.
TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20:!aNULL:!eNULL"


def _server_context() -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_ciphers(TLS12_CIPHERS)
    return context


@contextlib.contextmanager
def _as_files(*contents: bytes) -> Iterator[list[str]]:
    """Paths OpenSSL can read ``contents`` from: in-memory files on Linux, else a
    private temporary directory."""
    memfd = getattr(os, "memfd_create", None)
    if memfd is not None and os.path.isdir("/proc/self/fd"):
        fds = []
        try:
            for data in contents:
                fds.append(memfd("gpuslice-tls", 0))
                os.write(fds[-1], data)
            yield [f"/proc/self/fd/{fd}" for fd in fds]
        finally:
            for fd in fds:
                os.close(fd)
        return
    with tempfile.TemporaryDirectory(prefix="gpuslice-tls-") as scratch:
        paths = []
        for number, data in enumerate(contents):
            path = os.path.join(scratch, str(number))
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            paths.append(path)
        yield paths


class ReloadingTls:
    """The server context for ``cert_file`` and ``key_file``, kept current."""

    def __init__(self, cert_file: str | Path, key_file: str | Path) -> None:
        self.cert_file = Path(cert_file)
        self.key_file = Path(key_file)
        self.stats = TlsStats()
        self._seen: tuple[tuple[int, int, int, int], ...] | None = self._signatures()
        self._current = self._load()
        # The context uvicorn holds: its own pair serves only if the callback fails.
        self.context = self._load()
        self.context.sni_callback = self._choose

    def _choose(
        self, connection: ssl.SSLObject | ssl.SSLSocket, _name: str | None, _ctx: object
    ) -> None:
        connection.context = self._current

    def _signatures(self) -> tuple[tuple[int, int, int, int], ...]:
        try:
            return (_signature(self.cert_file), _signature(self.key_file))
        except OSError as exc:
            raise TlsError(f"cannot read {exc.filename}: {exc.strerror}") from None

    def _load(self) -> ssl.SSLContext:
        """A fresh server context with the files' current pair. Raises TlsError."""
        try:
            cert, key = self.cert_file.read_bytes(), self.key_file.read_bytes()
        except OSError as exc:
            raise TlsError(f"cannot read {exc.filename}: {exc.strerror}") from None
        context = _server_context()
        try:
            with _as_files(cert, key) as (cert_path, key_path):
                context.load_cert_chain(cert_path, key_path)
        except (ssl.SSLError, ValueError) as exc:
            raise TlsError(
                f"{self.cert_file} and {self.key_file} are not a usable certificate and key: {exc}"
            ) from None
        except OSError as exc:
            raise TlsError(f"cannot hand the certificate to OpenSSL: {exc}") from None
        return context

    def reload_if_changed(self) -> bool:
        """Load the files again if they changed since last time; True when reloaded.

        A pair that cannot be used is logged and counted once; the old one stays.
        """
        try:
            now = self._signatures()
        except TlsError as exc:
            if self._seen is not None:  # count a missing file once, not every poll
                self._seen = None
                self._failed(str(exc))
            return False
        if now == self._seen:
            return False
        self._seen = now
        try:
            self._current = self._load()
        except TlsError as exc:
            self._failed(str(exc))
            return False
        self.stats.reloads += 1
        log.info("serving the renewed certificate %s", self.cert_file)
        return True

    def _failed(self, message: str) -> None:
        if message != self.stats.last_error:
            log.error("keeping the current certificate: %s", message)
        self.stats.failures += 1
        self.stats.last_error = message

    async def watch(self, interval: float) -> None:
        """Check the files every ``interval`` seconds until cancelled."""
        while True:
            await asyncio.sleep(interval)
            try:
                self.reload_if_changed()
            except Exception:  # the watch must outlive any surprise
                log.exception("checking the certificate files failed")

"""gRPC server TLS (``serve --tls-cert-file --tls-key-file [--tls-client-ca-file]``) with the
files re-read when they change, so a rotated certificate (cert-manager) is served without a
restart: grpcio asks ``fetch`` before each new handshake; connections already open keep the
certificate they were made with.
"""

from __future__ import annotations

import logging
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
from prometheus_client import Counter

from inferencecache.config.reloading import Signature, signature

log = logging.getLogger("inferencecache.server")


class TlsConfigError(Exception):
    """A TLS file is missing, unreadable or not a matching certificate and key (one line)."""


@dataclass(frozen=True)
class TlsFiles:
    cert_file: str
    key_file: str
    client_ca_file: str = ""

    @property
    def mtls(self) -> bool:
        return bool(self.client_ca_file)


def _read(flag: str, path: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise TlsConfigError(f"cannot read {flag} {path!r}: {e.strerror or e}") from e
    if b"-----BEGIN" not in data:
        raise TlsConfigError(f"{flag} {path!r} holds no PEM block")
    return data


def load(files: TlsFiles) -> tuple[bytes, bytes, bytes | None]:
    """(cert chain, key, client CA) as PEM, checked to be a matching pair (stdlib ``ssl``)."""
    cert = _read("--tls-cert-file", files.cert_file)
    key = _read("--tls-key-file", files.key_file)
    ca = _read("--tls-client-ca-file", files.client_ca_file) if files.client_ca_file else None
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(files.cert_file, files.key_file)
        if files.client_ca_file:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(files.client_ca_file)
    except (ssl.SSLError, OSError, ValueError) as e:
        raise TlsConfigError(
            f"--tls-cert-file {files.cert_file!r} / --tls-key-file {files.key_file!r}"
            f"{' / --tls-client-ca-file ' + repr(files.client_ca_file) if ca else ''}: {e}"
        ) from e
    return cert, key, ca


class ReloadingServerCredentials:
    """``grpc.ServerCredentials`` whose certificate follows the files (checked by mtime, size
    and inode before each handshake; a half-written or mismatched pair keeps the previous one
    in force, logged and counted under ``result="error"``)."""

    def __init__(self, files: TlsFiles, reloads: Counter | None = None) -> None:
        self.files = files
        self._reloads = reloads
        self._lock = threading.Lock()
        self._stamp = self._stat()
        self._config = self._build(*load(files))

    def _stat(self) -> tuple[Signature | None, ...]:
        paths = (self.files.cert_file, self.files.key_file, self.files.client_ca_file)
        return tuple(signature(p) if p else None for p in paths)

    def _build(self, cert: bytes, key: bytes, ca: bytes | None) -> object:
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch(self) -> object | None:
        """grpcio's certificate-configuration fetcher: a new configuration, or None to keep
        the current one."""
        with self._lock:
            stamp = self._stat()
            if stamp == self._stamp:
                return None
            self._stamp = stamp
            try:
                self._config = self._build(*load(self.files))
            except TlsConfigError as e:
                self._count("error")
                log.error("TLS files not reloaded; the previous certificate stays in use",
                          extra={"error": str(e)})  # fmt: skip
                return None
            self._count("ok")
            log.info("TLS certificate reloaded", extra={"cert_file": self.files.cert_file})
            return self._config

    def _count(self, result: str) -> None:
        if self._reloads is not None:
            self._reloads.labels("tls", result).inc()

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._config,  # type: ignore[arg-type]
            self.fetch,  # type: ignore[arg-type]
            require_client_authentication=self.files.mtls,
        )

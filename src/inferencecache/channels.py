"""gRPC client channels with the credentials a secured server wants: TLS (a CA file, optionally
a client certificate for mTLS) and a bearer token sent as ``authorization`` metadata.

Every client command (subscriber, gateway, ``lookup``, doctor) declares the same four flags
through the ``*_setting()`` factories below and builds its channel with ``ChannelSecurity``,
so the flags and their meaning are the same everywhere (docs/security.md).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from inferencecache.config import setting
from inferencecache.config.reloading import signature

log = logging.getLogger("inferencecache.channels")

TOKEN_RELOAD_EVERY_S = 1.0
TLS_CHECK_EVERY_S = 1.0
"""How often (at most) a long-lived client looks whether its TLS files changed."""

Stamp = tuple[tuple[int, int, int] | None, ...]


def auth_token_file_setting() -> Any:
    return setting(
        "",
        help="File holding the bearer token sent to the server (authorization metadata); "
        "re-read when it changes. Empty: none.",
        metavar="PATH",
    )


def tls_ca_file_setting() -> Any:
    return setting(
        "",
        help="PEM CA bundle that signed the server's certificate: set, the gRPC connection uses "
        "TLS. Empty: plaintext.",
        metavar="PATH",
    )


def tls_cert_file_setting() -> Any:
    return setting(
        "", help="PEM client certificate for mTLS (with --tls-key-file).", metavar="PATH"
    )


def tls_key_file_setting() -> Any:
    return setting("", help="PEM private key of --tls-cert-file.", metavar="PATH")


def _read(flag: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {flag} {path!r}: {e.strerror or e}") from e


def read_token(path: str) -> str:
    """A token file's one token (surrounding whitespace stripped); ``ValueError`` otherwise."""
    try:
        token = _read("--auth-token-file", path).decode("utf-8").strip()
    except UnicodeDecodeError as e:
        raise ValueError(f"--auth-token-file {path!r} is not UTF-8") from e
    if not token or any(c.isspace() for c in token) or not token.isprintable():
        raise ValueError(f"--auth-token-file {path!r} must hold one token on one line")
    return token


@dataclass(frozen=True)
class ChannelSecurity:
    """A client's gRPC credentials (flags ``--auth-token-file``, ``--tls-ca-file``,
    ``--tls-cert-file``, ``--tls-key-file``)."""

    auth_token_file: str = ""
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    _token: list[tuple[float, tuple[int, int, int] | None, str]] = field(
        default_factory=list, compare=False, repr=False
    )
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    @classmethod
    def of(cls, settings: Any) -> ChannelSecurity:
        """From a settings object that declares the four flags."""
        return cls(
            settings.auth_token_file,
            settings.tls_ca_file,
            settings.tls_cert_file,
            settings.tls_key_file,
        )

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca_file)

    def check_flags(self) -> None:
        """The flags' combination (settings ``__post_init__``; no file is read)."""
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("--tls-cert-file and --tls-key-file go together")
        if self.tls_cert_file and not self.tls_ca_file:
            raise ValueError("--tls-cert-file (mTLS) needs --tls-ca-file")

    def validate(self) -> None:
        """Read every file once (a command's start); ``ValueError`` (one line) naming the
        first problem."""
        self.check_flags()
        if self.auth_token_file:
            read_token(self.auth_token_file)
        if self.tls:
            self.channel_credentials()

    def tls_stamp(self) -> Stamp:
        """(mtime, size, inode) of the CA, certificate and key files: what a long-lived client
        compares to notice a renewed certificate (``FollowedChannel``)."""
        files = (self.tls_ca_file, self.tls_cert_file, self.tls_key_file)
        return tuple(signature(p) if p else None for p in files)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        if self.tls_cert_file and self.tls_key_file:
            try:  # a key that is not the certificate's would only fail at the handshake
                ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(
                    self.tls_cert_file, self.tls_key_file)
            except (ssl.SSLError, OSError) as e:
                raise ValueError(f"--tls-cert-file {self.tls_cert_file!r} / --tls-key-file "
                                 f"{self.tls_key_file!r}: {e}") from None  # fmt: skip
        ca = _read("--tls-ca-file", self.tls_ca_file)
        cert = _read("--tls-cert-file", self.tls_cert_file) if self.tls_cert_file else None
        key = _read("--tls-key-file", self.tls_key_file) if self.tls_key_file else None
        for flag, data in (("--tls-ca-file", ca), ("--tls-cert-file", cert),
                           ("--tls-key-file", key)):  # fmt: skip
            if data is not None and b"-----BEGIN" not in data:
                raise ValueError(f"{flag} holds no PEM block")
        return grpc.ssl_channel_credentials(ca, key, cert)

    def authorization(self) -> str | None:
        """``Bearer <token>`` from the token file (re-read when it changes), or None."""
        if not self.auth_token_file:
            return None
        now = time.monotonic()
        with self._lock:
            cached = self._token[0] if self._token else None
            if cached is not None and now < cached[0]:
                return cached[2]
            stamp = signature(self.auth_token_file)
            if cached is not None and (stamp is None or stamp == cached[1]):
                value = cached[2]  # unchanged, or gone for now (keep the last token)
            else:
                try:
                    value = "Bearer " + read_token(self.auth_token_file)
                except ValueError:
                    if cached is None:
                        raise
                    value = cached[2]
            self._token[:] = [(now + TOKEN_RELOAD_EVERY_S, stamp, value)]
            return value

    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        """Call metadata carrying the bearer token, or None without one."""
        auth = self.authorization()
        return (("authorization", auth),) if auth is not None else None

    def channel(self, target: str, options: Any = None) -> grpc.Channel:
        """A sync channel: TLS when a CA is configured, else plaintext."""
        if self.tls:
            return grpc.secure_channel(target, self.channel_credentials(), options=options)
        return grpc.insecure_channel(target, options=options)

    def aio_channel(self, target: str, options: Any = None) -> grpc.aio.Channel:
        """An asyncio channel: TLS when a CA is configured, else plaintext."""
        if self.tls:
            return grpc.aio.secure_channel(target, self.channel_credentials(), options=options)
        return grpc.aio.insecure_channel(target, options=options)


def security_of(settings: Any) -> ChannelSecurity:
    """A command's ``ChannelSecurity`` with its files read once: a missing or malformed file
    is a usage error (exit 2, one line)."""
    import click

    sec = ChannelSecurity.of(settings)
    try:
        sec.validate()
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    return sec


class FollowedChannel:
    """An asyncio channel that is replaced when the TLS files change (a client certificate
    renewed by cert-manager): ``current()`` checks the files at most every
    ``TLS_CHECK_EVERY_S`` and, after a change, opens a new channel (new handshakes, the new
    certificate) and closes the old one after ``grace`` seconds, so calls in flight finish.
    A half-written pair keeps the current channel until the files are whole."""

    def __init__(self, target: str, security: ChannelSecurity, options: Any, grace: float) -> None:
        self.target = target
        self.security = security
        self.options = options
        self.grace = grace
        self.generation = 0
        self.channel = security.aio_channel(target, options=options)
        self._stamp = security.tls_stamp() if security.tls else None
        self._next_check = 0.0
        self._retired: set[asyncio.Task[None]] = set()

    def current(self) -> grpc.aio.Channel:
        if self._stamp is None:
            return self.channel
        now = time.monotonic()
        if now < self._next_check:
            return self.channel
        self._next_check = now + TLS_CHECK_EVERY_S
        stamp = self.security.tls_stamp()
        if stamp == self._stamp:
            return self.channel
        self._stamp = stamp
        try:
            fresh = self.security.aio_channel(self.target, options=self.options)
        except ValueError as e:
            log.warning("TLS files changed but are not usable yet; keeping the connection",
                        extra={"server": self.target, "err": str(e)})  # fmt: skip
            return self.channel
        old, self.channel = self.channel, fresh
        self.generation += 1
        try:
            task = asyncio.get_running_loop().create_task(old.close(grace=self.grace))
            self._retired.add(task)
            task.add_done_callback(self._retired.discard)
        except RuntimeError:  # no running loop (not expected): leave it to the collector
            pass
        log.info("TLS files changed; new connections use them", extra={"server": self.target})
        return fresh

    async def close(self) -> None:
        await self.channel.close(grace=None)
        for task in list(self._retired):
            task.cancel()


PLAINTEXT = ChannelSecurity()
"""No TLS, no token: the default of every client."""

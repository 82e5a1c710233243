"""Who may do what: the admin paths' static bearer token (contract-and-index.md §9.2, §9.6) and
the gRPC credentials of ``--credentials-file`` (roles, tenants, bearer-token hashes, client
certificate names; docs/security.md).

``Authorizer.authorize`` is the one check every gRPC method and the HTTP lookup listener call.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import Counter

from inferencecache.config import HostPort
from inferencecache.config.reloading import Signature, signature


class AuthConfigError(Exception):
    """The token file or the listener set is unusable; the message is one line."""


OK = "ok"
UNAUTH = "unauth"


def read_token_file(path: str) -> str:
    """The token is the file's content without surrounding whitespace; empty is an error."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise AuthConfigError(f"cannot read --admin-token-file {path!r}: {reason}") from e
    token = text.strip()
    if not token:
        raise AuthConfigError(f"--admin-token-file {path!r} is empty")
    if any(c.isspace() for c in token) or not token.isprintable():
        raise AuthConfigError(f"--admin-token-file {path!r} must hold one token on one line")
    return token


def check_listeners(token: str | None, listeners: Sequence[tuple[str, HostPort]]) -> None:
    """Without a token every listener must be on loopback (the admin paths are then open)."""
    if token is not None:
        return
    for flag, addr in listeners:
        if not addr.is_loopback:
            raise AuthConfigError(
                f"refusing to listen on non-loopback {flag} {addr} without --admin-token-file"
            )


class BearerAuth:
    """Checks ``Authorization: Bearer <token>`` in constant time; None = open (loopback only)."""

    def __init__(self, token: str | None) -> None:
        self._token = token.encode() if token is not None else None

    def check(self, header: str | None) -> str:
        """``ok`` or ``unauth`` for one request's Authorization header."""
        if self._token is None:
            return OK
        if not header:
            return UNAUTH
        scheme, _, value = header.strip().partition(" ")
        if scheme.lower() != "bearer":
            return UNAUTH
        presented = value.strip().encode("utf-8", "surrogateescape")
        return OK if hmac.compare_digest(presented, self._token) else UNAUTH



# -- gRPC credentials -----------------------------------------------------------------------------

PRODUCER = "producer"
READER = "reader"
ROLES = (PRODUCER, READER)

METHOD_ROLES: dict[str, str] = {
    "ReportCacheState": PRODUCER,
    "PublishEvent": PRODUCER,
    "LookupRoute": READER,
    "LookupPDRoute": READER,
    "GetCacheState": READER,
    "RenderTemplate": READER,
    "StreamCacheEvents": READER,
    "StreamMetrics": READER,
}
"""The role each InferenceCache method needs (docs/security.md)."""

ALL_TENANTS = "*"
UNAUTHENTICATED = "unauthenticated"
PERMISSION_DENIED = "permission_denied"
RELOAD_EVERY_S = 1.0
"""How often (at most) the credentials file's mtime is looked at on the request path."""

log = logging.getLogger("inferencecache.server")


@dataclass(frozen=True)
class Credential:
    """One line of the credentials file. ``tenants`` None = every tenant."""

    name: str
    roles: frozenset[str]
    tenants: frozenset[str] | None
    token_sha256: tuple[bytes, ...] = ()
    cert_names: frozenset[str] = frozenset()

    def may(self, role: str, tenant: str | None) -> bool:
        """Whether this credential may act as ``role`` on ``tenant`` (None: on every tenant,
        e.g. an unfiltered stream)."""
        if role not in self.roles:
            return False
        if self.tenants is None:
            return True
        return tenant is not None and (tenant in self.tenants or tenant == _probe_tenant())


def _probe_tenant() -> str:
    from inferencecache.index.model import PROBE_TENANT

    return PROBE_TENANT


ANONYMOUS_ADMIN = Credential("(auth off)", frozenset(ROLES), None)
"""What every caller is when no credentials are configured (the listener is then loopback, or
the operator chose ``--insecure-disable-auth``)."""

MTLS_ADMIN = Credential("(client certificate)", frozenset(ROLES), None)
"""Any client certificate the client CA signed, when mTLS is on without a credentials file."""


def parse_credentials(text: str, source: str = "--credentials-file") -> list[Credential]:
    """The credentials file: one credential per line, ``#`` comments, fields separated by
    whitespace::

        <name> <roles> <tenants> <secret> [<secret> ...]

    roles: ``producer``, ``reader``, ``admin`` (both) or a comma list; tenants: ``*`` or a comma
    list; secret: ``sha256:<64 hex>`` (SHA-256 of the bearer token) or ``cert:<name>`` (a client
    certificate whose subject CN or a SAN equals name). Raises ``AuthConfigError``."""
    out: list[Credential] = []
    names: set[str] = set()
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source} line {lineno}"
        fields = line.split()
        if len(fields) < 4:
            raise AuthConfigError(f"{where}: want <name> <roles> <tenants> <secret>...")
        name, roles_f, tenants_f, *secrets = fields
        if name in names:
            raise AuthConfigError(f"{where}: credential {name!r} appears twice")
        names.add(name)
        roles: set[str] = set()
        for r in roles_f.split(","):
            if r == "admin":
                roles.update(ROLES)
            elif r in ROLES:
                roles.add(r)
            else:
                raise AuthConfigError(f"{where}: unknown role {r!r} (producer, reader, admin)")
        tenants: frozenset[str] | None = None
        if tenants_f != ALL_TENANTS:
            listed = [t for t in tenants_f.split(",") if t]
            if not listed or ALL_TENANTS in listed:
                raise AuthConfigError(f"{where}: tenants must be * or a comma list of names")
            tenants = frozenset(listed)
        hashes: list[bytes] = []
        certs: set[str] = set()
        for sec in secrets:
            kind, _, value = sec.partition(":")
            if kind == "sha256":
                try:
                    digest = bytes.fromhex(value)
                except ValueError:
                    digest = b""
                if len(digest) != 32:
                    raise AuthConfigError(f"{where}: sha256: wants 64 hex digits")
                hashes.append(digest)
            elif kind == "cert" and value:
                certs.add(value)
            else:
                raise AuthConfigError(f"{where}: a secret is sha256:<hex> or cert:<name>")
        out.append(Credential(name, frozenset(roles), tenants, tuple(hashes), frozenset(certs)))
    return out


def token_sha256(token: str) -> str:
    """The ``sha256:`` secret for a bearer token (what ``inferencecache token-hash`` prints)."""
    return "sha256:" + hashlib.sha256(token.encode("utf-8")).hexdigest()


class CredentialsFile:
    """The credentials of one file, re-read when its mtime, size or inode change (checked at
    most every ``RELOAD_EVERY_S`` on the request path). A file that stops parsing keeps the
    last good credentials in force and is logged; start-up fails on it instead."""

    def __init__(self, path: str, reloads: Counter | None = None) -> None:
        self.path = path
        self._reloads = reloads
        self._lock = threading.Lock()
        self._next_check = 0.0
        self._stamp = self._stat()
        self.credentials = self._read()

    def _stat(self) -> Signature | None:
        return signature(self.path)

    def _read(self) -> list[Credential]:
        try:
            text = Path(self.path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            reason = getattr(e, "strerror", None) or str(e)
            raise AuthConfigError(f"cannot read --credentials-file {self.path!r}: {reason}") from e
        return parse_credentials(text)

    def current(self) -> list[Credential]:
        now = time.monotonic()
        if now < self._next_check:
            return self.credentials
        with self._lock:
            if now < self._next_check:
                return self.credentials
            self._next_check = now + RELOAD_EVERY_S
            stamp = self._stat()
            if stamp is not None and stamp != self._stamp:
                self._stamp = stamp
                try:
                    self.credentials = self._read()
                except AuthConfigError as e:
                    self._count("error")
                    log.error("credentials file not reloaded; the previous one stays in force",
                              extra={"error": str(e)})  # fmt: skip
                else:
                    self._count("ok")
                    log.info("credentials reloaded",
                             extra={"path": self.path, "credentials": len(self.credentials)})
        return self.credentials

    def _count(self, result: str) -> None:
        if self._reloads is not None:
            self._reloads.labels("credentials", result).inc()


class Denied(Exception):
    """A refused call: ``code`` is ``UNAUTHENTICATED`` or ``PERMISSION_DENIED``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _bearer(header: str | None) -> bytes | None:
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip().encode("utf-8", "surrogateescape")


class Authorizer:
    """The one authorization check of the gRPC methods and the HTTP lookup listener.

    ``required`` False (no credentials file, no client CA): every caller is
    ``ANONYMOUS_ADMIN`` and nothing is read per call. Otherwise a caller is identified by its
    bearer token (``authorization`` metadata / header; SHA-256 compared in constant time with
    every credential's hashes) or, on an mTLS connection, by its certificate names; the
    credential must hold the method's role and the request's tenant."""

    def __init__(
        self,
        credentials: CredentialsFile | None = None,
        *,
        mtls: bool = False,
        outcomes: Counter | None = None,
    ) -> None:
        self._file = credentials
        self._mtls = mtls
        self._outcomes = outcomes
        self.required = credentials is not None or mtls
        self._children: dict[tuple[str, str], Callable[[], None]] = {}
        self._flat: tuple[list[Credential], list[tuple[bytes, Credential]]] | None = None

    def _hashes(self, creds: list[Credential]) -> list[tuple[bytes, Credential]]:
        """(token hash, credential) of every credential, rebuilt when the file was reloaded."""
        cached = self._flat
        if cached is None or cached[0] is not creds:
            cached = self._flat = (creds, [(h, c) for c in creds for h in c.token_sha256])
        return cached[1]

    def count(self, method: str, outcome: str) -> None:
        if self._outcomes is None:
            return
        inc = self._children.get((method, outcome))
        if inc is None:
            inc = self._outcomes.labels(method, outcome).inc
            self._children[(method, outcome)] = inc
        inc()

    def identify(self, authorization: str | None, cert_names: Iterable[str] = ()) -> Credential:
        """The caller's credential, or ``Denied(UNAUTHENTICATED)``."""
        if not self.required:
            return ANONYMOUS_ADMIN
        creds = self._file.current() if self._file is not None else []
        token = _bearer(authorization)
        if token is not None:
            digest = hashlib.sha256(token).digest()
            found: Credential | None = None
            compare = hmac.compare_digest
            for h, c in self._hashes(creds):  # all compared: timing tells not which matched
                if compare(digest, h) and found is None:
                    found = c
            if found is not None:
                return found
            raise Denied(UNAUTHENTICATED, "unknown bearer token")
        names = set(cert_names)
        if names:
            for c in creds:
                if c.cert_names & names:
                    return c
            if self._mtls and self._file is None:
                return MTLS_ADMIN
            raise Denied(UNAUTHENTICATED, "client certificate maps to no credential")
        raise Denied(UNAUTHENTICATED, "no credentials")

    def authorize(
        self,
        method: str,
        authorization: str | None,
        cert_names: Iterable[str] = (),
        tenant: str | None = "",
        role: str | None = None,
    ) -> Credential:
        """The caller's credential if it may call ``method`` (as ``role``; default: the
        method's, ``METHOD_ROLES``) on ``tenant`` (None: every tenant); else ``Denied``
        (counted under ``method`` and the outcome)."""
        if not self.required:
            return ANONYMOUS_ADMIN
        try:
            cred = self.identify(authorization, cert_names)
        except Denied:
            self.count(method, UNAUTHENTICATED)
            raise
        self.check(method, cred, tenant, role)
        return cred

    def check(
        self, method: str, cred: Credential, tenant: str | None, role: str | None = None
    ) -> None:
        """``Denied(PERMISSION_DENIED)`` unless ``cred`` may call ``method`` on ``tenant``."""
        if cred.may(role or METHOD_ROLES.get(method, PRODUCER), tenant):
            self.count(method, OK)
            return
        self.count(method, PERMISSION_DENIED)
        what = "every tenant" if tenant is None else f"tenant {tenant!r}"
        raise Denied(PERMISSION_DENIED, f"credential {cred.name!r} may not call {method} "
                                        f"on {what}")  # fmt: skip


def check_grpc_listener(
    addr: HostPort, *, authenticated: bool, insecure_disable_auth: bool
) -> None:
    """A gRPC listener off loopback needs authentication (a credentials file or a client CA)
    unless the operator explicitly opted out."""
    if authenticated or insecure_disable_auth or addr.is_loopback:
        return
    raise AuthConfigError(
        f"refusing to serve gRPC on non-loopback --grpc-address {addr} without "
        "--credentials-file or --tls-client-ca-file (or --insecure-disable-auth)"
    )

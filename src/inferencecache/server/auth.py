"""Admin-path authentication: one static bearer token, or loopback-only when none
(contract-and-index.md §9.2, §9.6)."""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from pathlib import Path

from inferencecache.config import HostPort


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


class LookupAuth:
    """Who may ask LookupRoute, over gRPC and HTTP alike: the one check both transports call
    (``server.lookup_path.LookupPath``). Today lookups carry no credentials (the contract's
    gateways send none), so ``required`` is False and nothing is read per call; a credential
    scheme for lookups replaces ``check`` and sets ``required``."""

    required = False

    def check(self, credentials: str | None) -> str:
        """``ok`` or ``unauth`` for the caller's credentials (gRPC ``authorization`` metadata
        or the HTTP ``Authorization`` header)."""
        return OK

"""The one LookupRoute code path: the gRPC method and the HTTP lookup listener both call
``LookupPath.answer``, so both transports give the same answer to the same request.

What it does, in order: the auth check (``auth.Authorizer``, the same for both transports
and every gRPC method), the fail-open answer to an undecodable request (counted once, logged
at most every 10 s), the caller's deadline, ``Router.lookup``, one metric update, and the
encoding the transport asked for. Nothing here raises: any failure below it is ``NO_HINT``
(contract-and-index.md §2.5), the request counted as dropped
(``inferencecache_server_dropped_inputs_total{loop=<method>}``); only a denied credential
raises ``LookupDenied``, which each transport maps to its own status (gRPC
``UNAUTHENTICATED`` / ``PERMISSION_DENIED``, HTTP 401 / 403).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

from inferencecache.index.model import LookupRequest, LookupResult, Reason
from inferencecache.metrics import LazyChildren
from inferencecache.server import lookup_wire
from inferencecache.server.auth import READER, UNAUTHENTICATED, Authorizer, Denied
from inferencecache.server.metrics import ServerMetrics
from inferencecache.supervise import Drops, RateLimitedLog

log = logging.getLogger("inferencecache.server")


_T = TypeVar("_T")


class LookupBackend(Protocol):
    def monotonic(self) -> float: ...
    def lookup(self, request: LookupRequest) -> LookupResult: ...


class LookupDenied(Exception):
    """The auth check refused the caller: ``unauthenticated`` is True for a missing or unknown
    credential, False for one that may not read the request's tenant."""

    def __init__(self, message: str, unauthenticated: bool) -> None:
        super().__init__(message)
        self.unauthenticated = unauthenticated


def _no_peer() -> str:
    return ""


def _no_credentials() -> str | None:
    return None


def _no_cert_names() -> Iterable[str]:
    return ()


class LookupPath:
    """Auth, fail-open, deadline, lookup, metrics and encoding of one LookupRoute call."""

    def __init__(
        self,
        backend: LookupBackend,
        metrics: ServerMetrics,
        auth: Authorizer | None = None,
        logs: RateLimitedLog | None = None,
        drops: Drops | None = None,
    ) -> None:
        self._backend = backend
        self._metrics = metrics
        self._observe = metrics.observe_lookup
        self._errors = metrics.lookup_errors
        self._undecodable = LazyChildren(metrics.undecodable)
        self._auth = auth if auth is not None else Authorizer()
        self._logs = logs if logs is not None else RateLimitedLog(log)
        self.drops = drops if drops is not None else Drops(metrics.dropped_inputs, log)

    def answer(
        self,
        request: LookupRequest | lookup_wire._Undecodable,
        remaining_s: float | None,
        encode: Callable[[LookupResult], _T],
        *,
        method: str = "LookupRoute",
        peer: Callable[[], str] = _no_peer,
        credentials: Callable[[], str | None] = _no_credentials,
        cert_names: Callable[[], Iterable[str]] = _no_cert_names,
    ) -> _T:
        """The encoded answer to one request. ``remaining_s`` is the caller's deadline in
        seconds from now (None: none); ``encode`` must accept any ``LookupResult`` (the
        fail-open answer is encoded by it too)."""
        start = time.perf_counter()
        if self._auth.required:
            tenant = request.tenant_id if isinstance(request, LookupRequest) else None
            try:
                if tenant is None:  # undecodable: who asks still matters, the answer is NO_HINT
                    self._auth.identify(credentials(), cert_names())
                else:
                    self._auth.authorize(method, credentials(), cert_names(), tenant, READER)
            except Denied as e:
                if tenant is None:
                    self._auth.count(method, e.code)
                raise LookupDenied(f"{method}: {e}", e.code == UNAUTHENTICATED) from None
        if request is lookup_wire.UNDECODABLE:
            self.count_undecodable(method, peer)
            return self._fail_open("", start, encode)
        assert isinstance(request, LookupRequest)
        try:
            if remaining_s is not None:
                request.deadline = self._backend.monotonic() + remaining_s
            result = self._backend.lookup(request)
            resp = encode(result)
        except Exception as e:  # a bug below: this request fails open, the listener goes on
            self._errors.inc()
            self.drops.drop(method, e, model=request.model_id)
            return self._fail_open(request.model_id, start, encode)
        self._observe(
            request.model_id,
            result.reason_code,
            bool(result.replica_scores),
            result.lookup_latency_us / 1e6,
        )
        return resp

    def count_undecodable(self, method: str, peer: Callable[[], str] = _no_peer) -> None:
        """Count an undecodable request and log it (at most once per ``LOG_EVERY`` s)."""
        self._undecodable(method).inc()
        self._logs(logging.WARNING, method, "undecodable request", method=method, peer=peer(),
                   every_s=self._logs.every)  # fmt: skip

    def fail_open(self, model: str, encode: Callable[[LookupResult], _T]) -> _T:
        """The fail-open answer (counted as a lookup), for a caller whose request was dropped."""
        return self._fail_open(model, time.perf_counter(), encode)

    def _fail_open(self, model: str, start: float, encode: Callable[[LookupResult], _T]) -> _T:
        elapsed = time.perf_counter() - start
        self._observe(model, Reason.NO_HINT, False, elapsed)
        return encode(LookupResult(Reason.NO_HINT, [], int(elapsed * 1e6)))

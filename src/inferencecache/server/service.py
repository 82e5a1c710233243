"""The ``inferencecache.v1alpha1.InferenceCache`` gRPC service: translation only.

Registered as method handlers on grpcio's sync server (thread pool) rather than through the
generated servicer base class, so LookupRoute can use the wire-level deserializer of
``server.lookup_wire`` (ReportCacheState: ``server.report_request``) and every method can turn
an undecodable request into a decision of ours instead of grpcio's generic INTERNAL error.
LookupRoute also returns its response already serialized (``lookup_wire.encode_response``:
compiled when built).
Undecodable requests:

- LookupRoute / LookupPDRoute (gateways, on the request path): fail open, status OK, ``NO_HINT``.
- every other RPC: ``INVALID_ARGUMENT`` (a producer bug the producer should see); on a
  ReportCacheState stream the updates before the bad message stay applied.

Authorization (``auth.Authorizer``, docs/security.md): ``_guard`` checks every call's credential
and the tenants its request names before the handler runs (LookupRoute: ``LookupPath``); each
update of a ReportCacheState stream is checked as it arrives. ``UNAUTHENTICATED`` for a missing
or unknown credential, ``PERMISSION_DENIED`` for a role or tenant it lacks; on a stream the
updates before the refused one stay applied.

Anything else a request makes a handler raise (a bug: never an input the contract allows) drops
that request only: counted in ``inferencecache_server_dropped_inputs{loop=<method>, reason}``,
logged at most every 10 s per method and reason, answered ``NO_HINT`` (LookupRoute) or
``INTERNAL``; an update or event of a stream that fails to apply is skipped and the stream goes
on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Any, Protocol

import grpc

from inferencecache.index import batch as icb
from inferencecache.index.model import (
    PROBE_TENANT,
    EventLike,
    LookupRequest,
    LookupResult,
    PackedUpdate,
    Reason,
    StatsLike,
    Update,
)
from inferencecache.metrics import LazyChildren
from inferencecache.server import lookup_wire
from inferencecache.server.auth import (
    PERMISSION_DENIED,
    UNAUTHENTICATED,
    Authorizer,
    Credential,
    Denied,
)
from inferencecache.server.lookup_path import LookupDenied, LookupPath
from inferencecache.server.lookup_wire import encode_response
from inferencecache.server.metrics import ServerMetrics
from inferencecache.server.pd_route import PDRoutes
from inferencecache.server.render_template import Templates
from inferencecache.server.sink import DirectSink, IngestSink, LogUnavailable, safe_deserializer
from inferencecache.server.streams import Aborted, Streams
from inferencecache.supervise import Drops, RateLimitedLog
from inferencecache.v1alpha1 import inferencecache_pb2 as pb

log = logging.getLogger("inferencecache.server")

SERVICE_NAME = "inferencecache.v1alpha1.InferenceCache"
_NO_DEADLINE = 1e9  # grpcio reports "no deadline" as ~9.2e18 seconds remaining
_APPEND_WAIT = 10.0  # longest wait for the event log to take an ingest message (s)


def _peer(context: grpc.ServicerContext) -> str:
    try:
        return str(context.peer())
    except Exception:
        return ""


def _metadata(context: grpc.ServicerContext, key: str) -> str | None:
    """One invocation metadata value (read only when the lookup auth check needs it)."""
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return str(v)
    return None


def _cert_names(context: grpc.ServicerContext) -> tuple[str, ...]:
    """The peer certificate's subject CN and SANs (empty without mTLS)."""
    try:
        ctx = context.auth_context()
    except Exception:
        return ()
    names: list[str] = []
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        for v in ctx.get(key, ()):
            names.append(v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v))
    return tuple(names)


def _lazy_cert_names(context: grpc.ServicerContext) -> Iterator[str]:
    """``_cert_names``, read only if the auth check gets that far (no bearer token)."""
    yield from _cert_names(context)


def _request_tenants(method: str, request: Any) -> Iterable[str | None]:
    """The tenants one request (or stream message) acts on; None = every tenant."""
    if request is lookup_wire.UNDECODABLE:
        return ()  # answered INVALID_ARGUMENT / NO_HINT without touching any tenant
    if type(request) is bytes:  # an ICB1 batch of the ingest parsers
        try:
            return icb.tenants(request)
        except icb.BatchError:
            return (None,)
    tenant = getattr(request, "tenant_id", None)
    if tenant is None or (tenant == "" and method == "StreamCacheEvents"):
        return (None,)  # StreamMetrics, an unfiltered event stream: every tenant
    return (str(tenant),)


def _client_cancelled(context: grpc.ServicerContext) -> bool:
    """Whether grpcio recorded a client cancel for this RPC. No public accessor exists (sync
    ``is_active()`` is also False after a normal finish), so this reads grpcio's RPC state and
    answers False if that ever changes shape."""
    state = getattr(context, "_state", None)
    return getattr(state, "client", None) == "cancelled"


class CacheStateRow(StatsLike, Protocol):
    """One GetCacheState row: a replica's reported stats."""

    @property
    def replica_id(self) -> str: ...


class CacheStateView(Protocol):
    @property
    def replicas(self) -> Iterable[CacheStateRow]: ...
    @property
    def total_prefixes(self) -> int: ...
    @property
    def hot_prefixes(self) -> int: ...


class ServiceBackend(Protocol):
    """What the gRPC service needs from the index (all thread-safe, all synchronous)."""

    def monotonic(self) -> float: ...
    def apply_update(self, update: Update | PackedUpdate) -> None: ...
    def apply_batch(self, batch: bytes) -> None: ...
    def apply_event(self, event: EventLike) -> None: ...
    def lookup(self, request: LookupRequest) -> LookupResult: ...
    def cache_state(self, tenant_id: str, model_id: str) -> CacheStateView: ...


class InferenceCacheService:
    """Method implementations; ``handlers()`` returns the grpcio registration."""

    def __init__(
        self,
        backend: ServiceBackend,
        metrics: ServerMetrics,
        lookup: LookupPath | None = None,
        sink: IngestSink | None = None,
        streams: Streams | None = None,
        *,
        pd: PDRoutes | None = None,
        templates: Templates | None = None,
        auth: Authorizer | None = None,
    ) -> None:
        self._backend = backend
        self._auth = auth if auth is not None else Authorizer()
        self._streams = streams or Streams(getattr(backend, "observe", None), metrics.registry)
        self._metrics = metrics
        # where accepted ingest goes: the local index, or the event log (server/sink.py)
        self._sink: IngestSink = sink if sink is not None else DirectSink(backend)
        self._undecodable = LazyChildren(metrics.undecodable)
        self._ingested = LazyChildren(metrics.ingest_messages)
        self._stream_errors = LazyChildren(metrics.stream_errors)
        self._logs = RateLimitedLog(log)
        self._drops = Drops(metrics.dropped_inputs, log)
        self._lookup = lookup or LookupPath(backend, metrics, logs=self._logs, drops=self._drops)
        self._ingest_errors = LazyChildren(metrics.ingest_errors)
        self._pd = pd
        self._templates = templates

    # -- templates and P/D routes (contract-and-index.md §5.14, §5.15) --------------------------

    def render_template(self, request: Any, context: grpc.ServicerContext) -> Any:
        if request is lookup_wire.UNDECODABLE:
            self._reject(context, "RenderTemplate")
        if self._templates is None:
            return pb.RenderTemplateResponse(reason_code="TEMPLATE_NOT_FOUND")
        return self._templates.answer(request)

    def lookup_pd_route(self, request: Any, context: grpc.ServicerContext) -> Any:
        if request is lookup_wire.UNDECODABLE or self._pd is None:
            if request is lookup_wire.UNDECODABLE:
                self._bad_request("LookupPDRoute", context)
            return pb.LookupPDRouteResponse(reason_code=Reason.NO_HINT)
        return self._pd.answer(request)

    # -- streams (contract-and-index.md §13; server/streams.py) ----------------------------------

    def stream_cache_events(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        if request is lookup_wire.UNDECODABLE:
            self._reject(context, "StreamCacheEvents")
        scope = self._stream_scope(request, context)
        if scope is None:
            return iter(())
        return self._streams.cache_events(request, context, *scope)

    def _stream_scope(self, request: Any, context: grpc.ServicerContext) -> tuple[str, str] | None:
        """(tenant, model) an observer may see, or None for nothing (the probe tenant, as
        GetCacheState answers it). Today every caller may read every tenant, as with
        GetCacheState; an authorization check for GetCacheState belongs here too (empty
        ``tenant_id`` = every tenant is then the privileged case)."""
        if request.tenant_id == PROBE_TENANT:
            return None
        return str(request.tenant_id), str(request.model_id)

    def stream_metrics(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        if request is lookup_wire.UNDECODABLE:
            self._reject(context, "StreamMetrics")
        return self._streams.metrics(request, context)

    # -- lookups --------------------------------------------------------------------------------

    def lookup_route(self, request: LookupRequest | Any, context: grpc.ServicerContext) -> bytes:
        """Never a gRPC error: every failure here is a fail-open ``NO_HINT``
        (contract-and-index.md §2.5). Returns the serialized LookupRouteResponse
        (``lookup_wire.encode_response``). The work is ``LookupPath.answer``, shared with the
        HTTP lookup listener."""
        remaining = context.time_remaining()
        try:
            return self._lookup.answer(
                request,
                remaining if remaining is not None and remaining < _NO_DEADLINE else None,
                encode_response,
                peer=lambda: _peer(context),
                credentials=lambda: _metadata(context, "authorization"),
                cert_names=lambda: _lazy_cert_names(context),
            )
        except LookupDenied as e:
            self._deny(context, "LookupRoute",
                       Denied(UNAUTHENTICATED if e.unauthenticated else PERMISSION_DENIED,
                              str(e)))  # fmt: skip
            raise  # not reached: _deny raises

    def get_cache_state(self, request: Any, context: grpc.ServicerContext) -> Any:
        if request is lookup_wire.UNDECODABLE:
            self._reject(context, "GetCacheState")
        resp = pb.GetCacheStateResponse()
        resp.summary.SetInParent()
        if request.tenant_id == PROBE_TENANT:
            return resp
        view = self._backend.cache_state(request.tenant_id, request.model_id)
        for row in view.replicas:
            resp.replicas.add(
                replica_id=row.replica_id,
                cache_memory_bytes=row.cache_memory_bytes,
                hit_rate=row.hit_rate,
                pressure=row.pressure,
                t2_hit_tokens=row.t2_hit_tokens,
                t2_query_tokens=row.t2_query_tokens,
            )
        resp.summary.total_prefixes = view.total_prefixes
        resp.summary.hot_prefixes = view.hot_prefixes
        return resp

    # -- ingest ---------------------------------------------------------------------------------

    def report_cache_state(
        self, request_iterator: Iterator[Any], context: grpc.ServicerContext
    ) -> Any:
        """Apply each update on receipt; Ack at half-close (contract-and-index.md §4.1)."""
        ended: list[str] = []  # set once the handler decided how the stream ends

        def on_termination() -> None:
            # The client cancelled or the connection broke. Counted from gRPC's termination
            # callback: depending on timing the request iterator raises RpcError, or simply
            # stops as if the client had half-closed (the cancel is then seen only here).
            if not ended or (ended == ["ok"] and _client_cancelled(context)):
                self._stream_errors("cancelled").inc()

        context.add_callback(on_termination)
        pending: list[Future[None]] = []
        try:
            for msg in request_iterator:
                if msg is lookup_wire.UNDECODABLE:
                    ended.append("undecodable")
                    self._stream_errors("undecodable").inc()
                    self._reject(context, "ReportCacheState")
                fut = self._apply(msg, "update")
                if fut is not None:
                    pending.append(fut)
            self._settle(pending, "update", context)
        except LogUnavailable:
            ended.append("unavailable")
            self._unavailable(context)
        except _Rejected:
            ended.append("refused")  # an update the credential may not send: counted there
            raise
        ended.append("ok")
        return pb.Ack(accepted=True)

    def publish_event(self, request: Any, context: grpc.ServicerContext) -> Any:
        if request is lookup_wire.UNDECODABLE:
            self._reject(context, "PublishEvent")
        try:
            fut = self._apply(request, "event")
            if fut is not None:
                self._settle([fut], "event", context)
        except LogUnavailable:
            self._unavailable(context)
        return pb.Ack(accepted=True)

    def _settle(
        self, pending: list[Future[None]], kind: str, context: grpc.ServicerContext
    ) -> None:
        """Wait until the event log holds every message (``LogUnavailable`` if it failed)."""
        if not pending:
            return
        remaining = context.time_remaining()
        timeout = _APPEND_WAIT if remaining is None else max(0.0, min(remaining, _APPEND_WAIT))
        for fut in pending:
            try:
                fut.result(timeout)
            except LogUnavailable:
                raise
            except Exception as e:  # the wait timed out: the outcome is unknown, resend
                raise LogUnavailable("event log did not answer in time") from e
        self._ingested(kind).inc(len(pending))

    def _unavailable(self, context: grpc.ServicerContext) -> None:
        try:
            context.abort(grpc.StatusCode.UNAVAILABLE, "event log unavailable; retry later")
        except Exception as e:  # grpcio's abort raises a bare Exception
            raise _Rejected from e

    def _apply(self, msg: Any, kind: str) -> Future[None] | None:
        """Hand one update or event to the sink: applied now (None), or a Future for its
        append to the event log (``LogUnavailable`` propagates: the RPC answers UNAVAILABLE).
        An exception inside the index (a bug, never bad input the contract allows) skips that
        message, is counted and logged (rate-limited); the stream goes on, so a producer is not
        pushed into a resend loop by one poisoned message."""
        try:
            fut = self._sink.accept(kind, msg)  # already translated by the deserializer
        except LogUnavailable:
            raise
        except Exception as e:
            self._ingest_errors(kind).inc()
            self._drops.drop(
                "ReportCacheState" if kind == "update" else "PublishEvent",
                e,
                replica_id=getattr(msg, "replica_id", ""),
            )
            return None
        if fut is None:
            self._ingested(kind).inc()
        return fut

    # -- plumbing -------------------------------------------------------------------------------

    def _bad_request(self, method: str, context: grpc.ServicerContext) -> None:
        """Count an undecodable request and log it (at most once per 10 s per method)."""
        self._undecodable(method).inc()
        self._logs(logging.WARNING, method, "undecodable request", method=method,
                   peer=_peer(context), every_s=self._logs.every)  # fmt: skip

    def _reject(self, context: grpc.ServicerContext, method: str) -> None:
        self._bad_request(method, context)
        try:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: undecodable request")
        except Exception as e:  # grpcio's abort raises a bare Exception
            raise _Rejected from e

    def _deny(self, context: grpc.ServicerContext, method: str, e: Denied) -> None:
        code = grpc.StatusCode.UNAUTHENTICATED if e.code == UNAUTHENTICATED else \
            grpc.StatusCode.PERMISSION_DENIED  # fmt: skip
        self._logs(logging.WARNING, f"{method}:{e.code}", "call refused", method=method,
                   reason=str(e), peer=_peer(context), every_s=self._logs.every)  # fmt: skip
        try:
            context.abort(code, str(e) if str(e).startswith(method) else f"{method}: {e}")
        except Exception as err:  # grpcio's abort raises a bare Exception
            raise _Rejected from err

    def _authorized(self, method: str, request: Any, context: grpc.ServicerContext) -> Any:
        """The request once the caller's credential may make it (a ReportCacheState stream:
        an iterator checking each update as it arrives); aborts the call otherwise."""
        auth = self._auth
        try:
            cred = auth.identify(_metadata(context, "authorization"), _lazy_cert_names(context))
        except Denied as e:
            auth.count(method, e.code)
            self._deny(context, method, e)
        if method == "ReportCacheState":
            return self._checked_stream(method, cred, request, context)
        try:
            for tenant in _request_tenants(method, request) or ("",):
                auth.check(method, cred, tenant)
        except Denied as e:
            self._deny(context, method, e)
        return request

    def _checked_stream(
        self, method: str, cred: Credential, stream: Iterator[Any], context: grpc.ServicerContext
    ) -> Iterator[Any]:
        for msg in stream:
            try:
                for tenant in _request_tenants(method, msg):
                    self._auth.check(method, cred, tenant)
            except Denied as e:
                self._deny(context, method, e)
            yield msg

    def _guard(self, method: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` behind the auth check, with a last line of defence: an unexpected exception
        drops this request only (counted, logged rate-limited); LookupRoute still fails open,
        the others answer ``INTERNAL``. A cancelled stream (``RpcError``) and our own aborts
        pass through."""
        checked = self._auth.required and method != "LookupRoute"  # LookupPath checks its own

        def call(request: Any, context: grpc.ServicerContext) -> Any:
            try:
                if checked:
                    request = self._authorized(method, request, context)
                return fn(request, context)
            except (_Rejected, Aborted, grpc.RpcError):
                raise
            except Exception as e:
                reason = self._drops.drop(method, e, peer=_peer(context))
                if method == "LookupRoute":
                    return self._lookup.fail_open(getattr(request, "model_id", ""),
                                                  encode_response)  # fmt: skip
                if method == "LookupPDRoute":  # fail-open too (contract-and-index.md §5.14)
                    return pb.LookupPDRouteResponse(reason_code=Reason.NO_HINT)
                if method == "RenderTemplate":  # never a crash (contract-and-index.md §5.15)
                    return pb.RenderTemplateResponse(reason_code="RENDER_ERROR")
                context.abort(grpc.StatusCode.INTERNAL, f"{method}: request dropped ({reason})")

        return call

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        """Method name -> handler, for ``method_handlers_generic_handler`` and the registry."""
        unary = grpc.unary_unary_rpc_method_handler
        stream_in = grpc.stream_unary_rpc_method_handler
        stream_out = grpc.unary_stream_rpc_method_handler
        safe = safe_deserializer
        # LookupRoute and ReportCacheState have their own wire parsers (lookup_wire.py,
        # report_request.py); lookup_route returns the response bytes itself.
        table: dict[str, tuple[Any, Callable[..., Any], Callable[[bytes], Any]]] = {
            "RenderTemplate": (unary, self.render_template, safe(pb.RenderTemplateRequest)),
            "LookupRoute": (unary, self.lookup_route, lookup_wire.parse_lookup_request),
            "LookupPDRoute": (unary, self.lookup_pd_route, safe(pb.LookupPDRouteRequest)),
            "GetCacheState": (unary, self.get_cache_state, safe(pb.GetCacheStateRequest)),
            "ReportCacheState": (stream_in, self.report_cache_state,
                                 self._sink.update_deserializer()),
            "PublishEvent": (unary, self.publish_event, self._sink.event_deserializer()),
            "StreamCacheEvents": (stream_out, self.stream_cache_events,
                                  safe(pb.StreamEventsRequest)),
            "StreamMetrics": (stream_out, self.stream_metrics, safe(pb.StreamMetricsRequest)),
        }
        return {
            name: make(self._guard(name, fn), request_deserializer=parse,
                       response_serializer=None if name == "LookupRoute" else _serialize)
            for name, (make, fn, parse) in table.items()
        }


class _Rejected(Exception):
    """Raised after ``context.abort`` so the handler stops; grpcio keeps the abort status."""


def _serialize(msg: Any) -> bytes:
    return bytes(msg.SerializeToString())

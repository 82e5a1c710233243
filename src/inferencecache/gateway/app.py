"""The reference gateway: an OpenAI-compatible reverse proxy that routes on cache hints.

Per request: read and check the body, resolve the model (base model + LoRA adapter), compute the
prompt's token ids exactly as the engine will (``tokenize.openai``) and their fingerprint chain,
ask the policy's signal (LookupRoute for ``cache_aware``, the engines' caches for ``oracle``),
let the policy choose among the healthy engines, and stream the engine's answer back unchanged
with ``X-Cache-Route-*`` headers added. Nothing on the hint side can fail a request; an engine
that refuses connections is skipped and the request moves on to another one. docs/gateway.md
has the rules.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
import msgspec
from aiohttp import web

from inferencecache import fingerprint
from inferencecache.channels import ChannelSecurity
from inferencecache.gateway.engines import EnginePool
from inferencecache.gateway.errors import ApiError
from inferencecache.gateway.hints import HintClient, Hints, HttpHintClient, ReplicaHintClient
from inferencecache.gateway.metrics import GatewayMetrics
from inferencecache.gateway.oracle import query_oracle
from inferencecache.gateway.pd import PDClient, decode_body, prefill_body, run_prefill
from inferencecache.gateway.settings import GatewaySettings
from inferencecache.metrics import metrics_response
from inferencecache.routing import reasons
from inferencecache.routing.model import Decision, Hint, RouteInput, RoutingPolicy
from inferencecache.tokenize.openai import (
    EngineTokenizer,
    PromptError,
    UnsupportedPrompt,
    chat_prompt_ids,
    completion_prompt_ids,
)
from inferencecache.web import Listener, guard_middleware, read_limited

log = logging.getLogger("inferencecache.gateway")

ENDPOINTS: Final = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
HOP_BY_HOP: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "expect",  # answered by our own server; the engine gets the whole body at once
    }
)
OFFLOAD_BYTES: Final = 64 * 1024
"""Bodies at least this large are tokenized on a worker thread, off the event loop."""
_JSON: Final = msgspec.json.Decoder()  # ~2.5x json.loads on token-list bodies
BUFFER_BYTES: Final = 1024 * 1024
"""Engine answers with a Content-Length up to this size are relayed in one piece."""
NO_REASON: Final = "NONE"
UNKNOWN_LOG_INTERVAL: Final = 60.0

H_REPLICA: Final = "X-Cache-Route-Replica"
H_REASON: Final = "X-Cache-Route-Reason"
H_POLICY: Final = "X-Cache-Route-Policy"
H_FALLBACK: Final = "X-Cache-Route-Fallback"
H_HINT_US: Final = "X-Cache-Route-Hint-Us"
H_ORACLE_US: Final = "X-Cache-Route-Oracle-Us"
H_OVERHEAD_US: Final = "X-Cache-Route-Overhead-Us"
H_PROMPT_TOKENS: Final = "X-Cache-Route-Prompt-Tokens"
H_MATCHED: Final = "X-Cache-Route-Matched-Tokens"
H_ATTEMPTS: Final = "X-Cache-Route-Attempts"
H_PD_REASON: Final = "X-Cache-Route-PD-Reason"
H_PREFILL: Final = "X-Cache-Route-Prefill-Replica"
H_TRANSPORT: Final = "X-Cache-Route-Transport"

# Hints whose lookup latency is reported in the H_HINT_US header (a lookup was attempted).
_TIMED_HINT_CODES: Final = reasons.SERVER_CODES | {reasons.HINT_TIMEOUT, reasons.HINT_ERROR}

_FALLBACK_CAUSE: Final = {
    reasons.NO_HINT: "no_hint",
    reasons.TIMEOUT: "no_hint",
    reasons.POLICY_REQUIRES_CHAIN: "no_hint",
    reasons.UNKNOWN_TENANT: "unknown",
    reasons.UNKNOWN_MODEL: "unknown",
    reasons.UNKNOWN_HASH_SCHEME: "unknown",
    reasons.HINT_TIMEOUT: "timeout",
    reasons.HINT_ERROR: "server_error",
    reasons.HINT_UNAVAILABLE: "server_error",
    reasons.HINT_SKIPPED: "no_chain",
    reasons.HINTED_REPLICA_UNHEALTHY: "replica_unhealthy",
    reasons.UNRECOGNIZED: "unrecognized",
    reasons.ORACLE_UNAVAILABLE: "oracle_unavailable",
}


@dataclass
class _Request:
    """One proxied request as it moves through the gateway."""

    endpoint: str
    body: bytes
    model: str
    route: RouteInput
    started: float
    upstream_headers: list[tuple[str, str]]
    oracle_s: float | None = None
    attempts: int = 0
    extra: dict[str, str] = field(default_factory=dict)


async def _read_limited(request: web.Request, limit: int) -> bytes:
    """The body, or 413 when larger than ``limit`` bytes (checked before and while reading)."""
    body = await read_limited(request, limit)
    if body is None:
        raise ApiError(413, f"request body is larger than {limit} bytes", "request_too_large")
    return body


def fingerprint_request(
    endpoint: str, data: Mapping[str, Any], tok: EngineTokenizer | None, block_size: int
) -> tuple[list[int] | None, bytes]:
    """(engine prompt ids or None when they cannot be reproduced, packed chain)."""
    try:
        if endpoint == "completions":
            ids = completion_prompt_ids(tok, data)
        else:
            ids = chat_prompt_ids(tok, data)
    except PromptError:
        raise
    except UnsupportedPrompt:
        return None, b""
    except Exception:  # a tokenizer bug must not fail the request: route without a fingerprint
        log.warning("tokenization failed; routing without a fingerprint", exc_info=True)
        return None, b""
    return ids, fingerprint.chain_packed(ids, block_size)


class Gateway:
    """One gateway: its HTTP listener, engine pool, hint client and routing policy."""

    def __init__(
        self,
        settings: GatewaySettings,
        *,
        tokenizers: Mapping[str, EngineTokenizer] | None = None,
        metrics: GatewayMetrics | None = None,
        policy: RoutingPolicy | None = None,
    ) -> None:
        self.settings = settings
        self.tokenizers = dict(tokenizers or {})
        self.metrics = metrics or GatewayMetrics()
        self.policy = policy or settings.build_policy()
        self.port = 0
        self._session: aiohttp.ClientSession | None = None
        self._pool: EnginePool | None = None
        self._hints: Hints | None = None
        self._pd: PDClient | None = None
        self._listener: Listener | None = None
        self._unknown_logged: dict[tuple[str, str, str], float] = {}

    @property
    def pool(self) -> EnginePool:
        assert self._pool is not None, "gateway not started"
        return self._pool

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self, sock: socket.socket) -> None:
        """Serve on an already bound listening socket (bind errors surface before this)."""
        s = self.settings
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True),
            # A proxy: never keep one client's cookies for another, never ask for an encoding
            # the client did not ask for (bodies pass through undecoded), add no User-Agent.
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("Accept-Encoding", "User-Agent"),
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(
                total=None, connect=s.connect_timeout, sock_read=s.upstream_timeout
            ),
        )
        self._pool = EnginePool(
            s.engine_specs,
            self._session,
            self.metrics,
            interval=s.health_interval,
            timeout=s.health_timeout,
            backoff_max=s.health_backoff_max,
            discover_models=s.discover_models,
            static_adapters=s.adapter_bases,
        )
        if self.policy.needs_hint:
            # one hint source: an in-process event-log replica, else the HTTP lookup
            # listener, else gRPC (docs/gateway.md, "Where hints come from")
            if s.event_log:
                self._hints = ReplicaHintClient(s.event_log, s.event_log_key, s.hash_scheme,
                                                s.block_size)
            elif s.lookup_url:
                self._hints = HttpHintClient(s.lookup_url, s.lookup_timeout, s.hash_scheme,
                                             s.block_size, ChannelSecurity.of(s))
            else:
                self._hints = HintClient(str(s.server), s.lookup_timeout, s.hash_scheme,
                                         s.block_size, ChannelSecurity.of(s))
            await asyncio.gather(self._hints.start(connect_wait=1.0), self._pool.start())
        else:
            await self._pool.start()
        if s.pd_topology:
            self._pd = PDClient(str(s.server), s.lookup_timeout, s.pd_topology,
                                ChannelSecurity.of(s))
            await self._pd.start()
        app = web.Application(
            client_max_size=s.max_body_bytes + 1,
            middlewares=[guard_middleware(self.metrics.drops)],
        )
        for path in ENDPOINTS:
            app.router.add_route("*", path, self._proxy)
        app.router.add_route("*", "/v1/models", self._models)
        app.router.add_route("*", "/metrics", self._metrics_page)
        app.router.add_route("*", "/healthz", self._healthz)
        app.router.add_route("*", "/readyz", self._readyz)
        app.router.add_route("*", "/{tail:.*}", self._not_found)
        self._listener = Listener(app)
        self.port = await self._listener.start_socket(sock)

    async def stop(self) -> None:
        if self._listener is not None:
            await self._listener.stop()
            self._listener = None
        if self._pool is not None:
            await self._pool.stop()
        if self._hints is not None:
            await self._hints.close()
            self._hints = None
        if self._pd is not None:
            await self._pd.close()
            self._pd = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- small endpoints -------------------------------------------------------------------------

    async def _not_found(self, request: web.Request) -> web.StreamResponse:
        self.metrics.bad_requests("not_found").inc()
        return ApiError(404, f"unknown path {request.path}", "not_found").response()

    def _method(self, request: web.Request, allowed: str) -> ApiError | None:
        if request.method == allowed or (allowed == "GET" and request.method == "HEAD"):
            return None
        self.metrics.bad_requests("method_not_allowed").inc()
        return ApiError(
            405,
            f"method {request.method} is not allowed on {request.path}; use {allowed}",
            "method_not_allowed",
        )

    async def _metrics_page(self, request: web.Request) -> web.StreamResponse:
        if (err := self._method(request, "GET")) is not None:
            return err.response({"Allow": "GET"})
        return metrics_response(self.metrics.registry)

    def _engine_states(self) -> dict[str, dict[str, Any]]:
        return {
            rid: {"healthy": e.healthy, "in_flight": e.in_flight, "url": e.base_url}
            for rid, e in sorted(self.pool.engines.items())
        }

    async def _healthz(self, request: web.Request) -> web.StreamResponse:
        if (err := self._method(request, "GET")) is not None:
            return err.response({"Allow": "GET"})
        problem = self.metrics.loops.health()
        return web.json_response(
            {"status": problem or "ok", "policy": self.policy.name,
             "engines": self._engine_states()},
            status=200 if problem is None else 503,
        )

    async def _readyz(self, request: web.Request) -> web.StreamResponse:
        if (err := self._method(request, "GET")) is not None:
            return err.response({"Allow": "GET"})
        ready = bool(self.pool.healthy_ids())
        return web.json_response(
            {"ready": ready, "engines": self._engine_states()}, status=200 if ready else 503
        )

    async def _models(self, request: web.Request) -> web.StreamResponse:
        if (err := self._method(request, "GET")) is not None:
            return err.response({"Allow": "GET"})
        if not self.pool.healthy_ids():
            self.metrics.bad_requests("no_healthy_engine").inc()
            return ApiError(503, "no healthy engine", "no_healthy_engine").response()
        data = await self.pool.fetch_models()
        return web.json_response({"object": "list", "data": data})

    # -- the proxy -------------------------------------------------------------------------------

    async def _proxy(self, request: web.Request) -> web.StreamResponse:
        endpoint = ENDPOINTS[request.path]
        started = time.perf_counter()
        if (err := self._method(request, "POST")) is not None:
            self.metrics.requests(endpoint, "none", NO_REASON, "405").inc()
            return err.response({"Allow": "POST"})
        try:
            req = await self._prepare(request, endpoint, started)
            if self._pd is not None:
                return await self._pd_dispatch(request, req)
            return await self._dispatch(request, req)
        except ApiError as e:
            self.metrics.bad_requests(e.code).inc()
            self.metrics.requests(endpoint, "none", NO_REASON, str(e.status)).inc()
            return e.response()
        except Exception as e:  # a bug: answer this request, keep serving the others
            self.metrics.drops.drop("proxy", e, endpoint=endpoint)
            self.metrics.bad_requests("internal_error").inc()
            self.metrics.requests(endpoint, "none", NO_REASON, "500").inc()
            return ApiError(500, "internal gateway error", "internal_error").response()

    async def _prepare(self, request: web.Request, endpoint: str, started: float) -> _Request:
        s = self.settings
        body = await _read_limited(request, s.max_body_bytes)
        try:
            data = _JSON.decode(body)
        except (msgspec.DecodeError, ValueError, UnicodeDecodeError, RecursionError) as e:
            raise ApiError(400, f"request body is not valid JSON: {e}", "invalid_json") from None
        if not isinstance(data, dict):
            raise ApiError(400, "request body must be a JSON object", "invalid_request")
        model = data.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(400, "missing required field 'model'", "missing_field", "model")
        resolved = self.pool.resolve(model)
        if resolved is None:
            raise ApiError(404, f"The model `{model}` does not exist.", "model_not_found", "model")
        base, adapter = resolved
        tok = (self.tokenizers.get(adapter) if adapter else None) or self.tokenizers.get(base)
        t_tok = time.perf_counter()
        try:
            if len(body) >= OFFLOAD_BYTES:
                ids, chain = await asyncio.to_thread(
                    fingerprint_request, endpoint, data, tok, s.block_size
                )
            else:
                ids, chain = fingerprint_request(endpoint, data, tok, s.block_size)
        except PromptError as e:
            code = "missing_field" if "missing required field" in str(e) else "invalid_field"
            raise ApiError(400, str(e), code, e.param) from None
        self.metrics.tokenize.observe(time.perf_counter() - t_tok)
        tenant = request.headers.get(s.tenant_header, "").strip() or s.tenant_id
        route = RouteInput(
            tenant_id=tenant,
            model_id=base,
            adapter_id=adapter,
            tokens=ids if ids is not None else (),
            chain=chain,
            block_size=s.block_size,
        )
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
        if "Content-Type" not in request.headers:
            headers.append(("Content-Type", "application/json"))  # we parsed it: it is JSON
        req = _Request(endpoint, body, model, route, started, headers)
        if ids is not None:
            req.extra[H_PROMPT_TOKENS] = str(len(ids))
        if self.policy.needs_hint and self._pd is None:  # P/D mode asks only when it falls back
            await self._ask_hint(req)
        return req

    async def _ask_hint(self, req: _Request) -> None:
        route = req.route
        route.hint = await self._hint(route)
        if route.hint.reason_code in _TIMED_HINT_CODES:
            req.extra[H_HINT_US] = str(round(route.hint.latency_s * 1e6))

    async def _hint(self, route: RouteInput) -> Hint:
        if not route.chain or self._hints is None:
            hint = Hint(reasons.HINT_SKIPPED)
        else:
            hint = await self._hints.lookup(
                route.tenant_id, route.model_id, route.adapter_id, route.chain
            )
            if hint.reason_code in reasons.SERVER_CODES:
                self.metrics.hint_latency.observe(hint.latency_s)
        code = hint.reason_code
        self.metrics.hints(code if code in reasons.ALL else reasons.UNRECOGNIZED).inc()
        if code in reasons.UNKNOWN_CODES:
            self._log_unknown(code, route)
        return hint

    def _log_unknown(self, code: str, route: RouteInput) -> None:
        """UNKNOWN_* means the gateway and the subscribers disagree (contract-and-index.md §5.12):
        say so, sparingly."""
        key = (code, route.tenant_id, route.model_id)
        now = time.monotonic()
        last = self._unknown_logged.get(key)
        if last is not None and now - last < UNKNOWN_LOG_INTERVAL:
            return
        if len(self._unknown_logged) > 1024:
            self._unknown_logged.clear()
        self._unknown_logged[key] = now
        log.warning(
            "LookupRoute answered %s: tenant/model/hash scheme unknown to the index; check "
            "--tenant-id/--tenant-header, the model id and --hash-scheme against the "
            "subscribers' (routing round robin meanwhile)",
            code,
            extra={
                "reason_code": code,
                "tenant": route.tenant_id,
                "model": route.model_id,
                "hash_scheme": self.settings.hash_scheme,
            },
        )

    async def _dispatch(self, request: web.Request, req: _Request) -> web.StreamResponse:
        pool = self.pool
        route = req.route
        excluded: set[str] = set()
        oracle_asked = False
        while True:
            healthy = [r for r in pool.healthy_ids(req.model) if r not in excluded]
            if not healthy:
                raise ApiError(
                    503,
                    f"no healthy engine serves model `{req.model}`"
                    + (" (every engine tried failed)" if excluded else ""),
                    "no_healthy_engine",
                )
            route.load = pool.load()
            if self.policy.needs_oracle and not oracle_asked:
                oracle_asked = True
                if route.tokens:
                    assert self._session is not None
                    route.oracle, req.oracle_s = await query_oracle(
                        self._session,
                        pool,
                        healthy,
                        req.model,
                        route.tokens,
                        self.settings.oracle_timeout,
                        self.metrics,
                    )
            decision = self.policy.choose(route, healthy)
            if decision.replica not in healthy:  # a policy bug must not send traffic astray
                decision = Decision(healthy[0], decision.reason, True)
            self.policy.observe(route, decision.replica)
            req.attempts += 1
            if req.attempts == 1:
                self.metrics.overhead.observe(time.perf_counter() - req.started)
                if decision.fallback:
                    cause = _FALLBACK_CAUSE.get(decision.reason, "unrecognized")
                    self.metrics.fallbacks(cause).inc()
            resp = await self._forward(request, req, decision)
            if resp is not None:
                return resp
            excluded.add(decision.replica)

    async def _pd_dispatch(self, request: web.Request, req: _Request) -> web.StreamResponse:
        """P/D mode (``gateway.pd``): prefill on LookupPDRoute's prefill replica, decode on its
        decode replica; whatever is missing sends the request to one engine (``_dispatch``)."""
        assert self._pd is not None and self._session is not None
        route = req.route
        pd = await self._pd.route(route.tenant_id, route.model_id, route.chain, route.block_size)
        req.extra[H_PD_REASON] = pd.reason_code
        healthy = set(self.pool.healthy_ids(req.model))
        if not pd.prefill or not pd.decode:
            outcome = "no_pair"
        elif pd.prefill not in healthy or pd.decode not in healthy:
            outcome = "unhealthy"
        else:
            data = _JSON.decode(req.body)
            self.pool.begin(pd.prefill)
            try:
                url = self.pool.engines[pd.prefill].url(request.path_qs)
                result, kv = await run_prefill(
                    self._session, url, prefill_body(data), req.upstream_headers
                )
            finally:
                self.pool.end(pd.prefill)
            outcome = f"prefill_{result}"
            if kv is not None:
                original = req.body
                req.body = decode_body(data, kv)
                req.extra[H_PREFILL] = pd.prefill
                req.extra[H_TRANSPORT] = pd.transport
                req.attempts += 1
                self.metrics.overhead.observe(time.perf_counter() - req.started)
                resp = await self._forward(request, req, Decision(pd.decode, pd.reason_code))
                if resp is not None:
                    self.metrics.pd_requests("pd").inc()
                    return resp
                outcome = "decode_failed"
                req.body = original
                del req.extra[H_PREFILL], req.extra[H_TRANSPORT]
        self.metrics.pd_requests(outcome).inc()
        if self.policy.needs_hint:
            await self._ask_hint(req)
        return await self._dispatch(request, req)

    def _route_headers(self, req: _Request, decision: Decision) -> dict[str, str]:
        route = req.route
        h = {
            H_REPLICA: decision.replica,
            H_REASON: decision.reason,
            H_POLICY: self.policy.name,
            H_FALLBACK: "true" if decision.fallback else "false",
            H_OVERHEAD_US: str(round((time.perf_counter() - req.started) * 1e6)),
            **req.extra,
        }
        if req.attempts > 1:
            h[H_ATTEMPTS] = str(req.attempts)
        if req.oracle_s is not None:
            h[H_ORACLE_US] = str(round(req.oracle_s * 1e6))
        matched: int | None = None
        hint = route.hint
        if hint is not None and not decision.fallback and hint.matched_tokens:
            with_counts = dict(zip(hint.replicas, hint.matched_tokens, strict=False))
            matched = with_counts.get(decision.replica)
        elif route.oracle is not None:
            matched = route.oracle.get(decision.replica)
        if matched is not None:
            h[H_MATCHED] = str(matched)
        return h

    async def _forward(
        self, request: web.Request, req: _Request, decision: Decision
    ) -> web.StreamResponse | None:
        """Proxy to one engine; None means "not delivered, try another engine"."""
        assert self._session is not None
        rid = decision.replica
        pool = self.pool
        route_headers = self._route_headers(req, decision)
        pool.begin(rid)
        status = "502"
        try:
            try:
                up = await self._session.post(
                    pool.engines[rid].url(request.path_qs),
                    data=req.body,
                    headers=req.upstream_headers,
                )
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
                self.metrics.upstream_errors(rid, "connect").inc()
                pool.mark_down(rid, type(e).__name__)
                return None
            except aiohttp.SocketTimeoutError:
                self.metrics.upstream_errors(rid, "timeout").inc()
                pool.suspect(rid)
                status = "504"
                return ApiError(
                    504, f"engine {rid} did not answer in time", "upstream_timeout"
                ).response(route_headers)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                self.metrics.upstream_errors(rid, "disconnect").inc()
                pool.suspect(rid)
                return None
            except aiohttp.ClientError as e:
                self.metrics.upstream_errors(rid, "disconnect").inc()
                pool.suspect(rid)
                return ApiError(
                    502, f"engine {rid} failed: {type(e).__name__}", "bad_gateway"
                ).response(route_headers)
            try:
                status = str(up.status)
                if up.status >= 500:
                    self.metrics.upstream_errors(rid, "status_5xx").inc()
                    pool.suspect(rid)
                return await self._relay(request, up, rid, route_headers)
            except ApiError as e:
                status = str(e.status)
                return e.response(route_headers)
            finally:
                up.release()
        finally:
            pool.end(rid)
            self.metrics.requests(req.endpoint, rid, decision.reason, status).inc()

    async def _relay(
        self,
        request: web.Request,
        up: aiohttp.ClientResponse,
        rid: str,
        route_headers: dict[str, str],
    ) -> web.StreamResponse:
        """Stream the engine's response to the client, chunk by chunk, as it arrives."""
        ours = {k.lower() for k in route_headers}
        headers = [
            (k, v)
            for k, v in up.headers.items()
            if k.lower() not in HOP_BY_HOP and k.lower() not in ours
        ]
        headers.extend(route_headers.items())
        chunked = "chunked" in up.headers.get("Transfer-Encoding", "").lower()
        length = up.content_length
        if length is not None and not chunked and length <= BUFFER_BYTES:
            # A complete small answer (the non-streaming case): one read, one write.
            try:
                payload = await up.read()
            except (aiohttp.ClientError, TimeoutError) as e:
                self.metrics.upstream_errors(rid, "stream_broken").inc()
                self.pool.suspect(rid)
                raise ApiError(
                    502, f"engine {rid} failed mid-response: {type(e).__name__}", "bad_gateway"
                ) from None
            return web.Response(
                status=up.status, reason=up.reason, headers=headers, body=payload
            )
        resp = web.StreamResponse(status=up.status, reason=up.reason, headers=headers)
        if length is not None and not chunked:
            resp.content_length = length
        await resp.prepare(request)
        sse = up.content_type == "text/event-stream"
        while True:
            try:
                chunk = await up.content.readany()
            except (aiohttp.ClientError, TimeoutError) as e:
                self.metrics.upstream_errors(rid, "stream_broken").inc()
                self.pool.suspect(rid)
                log.warning(
                    "engine stream broke mid-response",
                    extra={"replica": rid, "err": type(e).__name__},
                )
                up.close()
                if sse:
                    err = ApiError(502, f"engine {rid} stream broke", "bad_gateway")
                    try:
                        await resp.write(
                            b"data: " + json.dumps(err.body()).encode() + b"\n\ndata: [DONE]\n\n"
                        )
                        await resp.write_eof()
                    except (ConnectionError, aiohttp.ClientError):
                        pass
                else:  # a truncated body must look truncated: drop the connection
                    resp.force_close()
                    if request.transport is not None:
                        request.transport.close()
                return resp
            if not chunk:
                break
            try:
                await resp.write(chunk)
            except (ConnectionError, aiohttp.ClientError):  # the client went away
                up.close()  # the engine sees the disconnect and can abort the request
                return resp
        await resp.write_eof()
        return resp

"""The simulated engine server: ``inferencecache fake-engine --mode simulated``.

An OpenAI-compatible engine whose "GPU" is :class:`~.simulated.EngineModel` running in real time:

* ``POST /v1/completions`` and ``/v1/chat/completions`` (streaming or not). Prompts are token ids,
  or text tokenized exactly as the gateway does (``inferencecache.tokenize.openai``, with the
  models of ``--tokenizer-dir``). The response (or the first SSE chunk) is sent when the prompt's
  prefill ends, so the client's time to first token is queueing + prefill of uncached tokens; the
  rest follows when decoding ends. ``usage.prompt_tokens_details.cached_tokens`` is the hit.
* ``GET /v1/models``: the base model (``--model-name``) and the LoRA adapters of
  ``--lora-adapters`` with ``parent`` = the base model, as vLLM lists them.
* ``GET /metrics`` (vLLM names: running/waiting, prefix-cache queries/hits, KV usage) and
  ``GET /health``.
* ``POST /reset_prefix_cache`` (vLLM's endpoint): forget every block, publish AllBlocksCleared.
* ``POST /debug/cache/match`` ``{"model", "tokens"}`` → ``{"matched_tokens": n}``: the oracle
  policy's view (docs/gateway.md), read-only.

Every store and eviction is published as real KV events (one batch per admission) by the
fake engine's :class:`~.publisher.EventPublisher`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import time
import uuid
from collections.abc import Mapping
from typing import Any, Final

import zmq.asyncio
from aiohttp import web

from inferencecache.config import parse_host_port
from inferencecache.engines.metrics import EngineMetrics, MetricsPage
from inferencecache.engines.publisher import EventPublisher
from inferencecache.engines.settings import FakeEngineSettings
from inferencecache.engines.simulated import Admitted, EngineModel, EngineParams
from inferencecache.subscriber.lora import parse_adapter_names
from inferencecache.tokenize.openai import (
    EngineTokenizer,
    PromptError,
    UnsupportedPrompt,
    chat_prompt_ids,
    completion_prompt_ids,
)
from inferencecache.web import Listener, guard_middleware

log = logging.getLogger("inferencecache.engines")

MATCH_PATH: Final = "/debug/cache/match"
RESET_PATH: Final = "/reset_prefix_cache"
DEFAULT_MAX_TOKENS: Final = 16
MAX_BODY: Final = 64 * 1024 * 1024


class _Error(Exception):
    """An OpenAI-style error answer."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind

    def response(self) -> web.Response:
        body = {"error": {"message": str(self), "type": self.kind, "param": None,
                          "code": self.status}}
        return web.json_response(body, status=self.status)


class SimulatedEngine:
    """Engine model + publisher + metrics behind the OpenAI routes (one replica)."""

    def __init__(
        self,
        params: EngineParams,
        publisher: EventPublisher,
        metrics: EngineMetrics,
        *,
        model_name: str,
        adapters: Mapping[int, str] | None = None,
        tokenizers: Mapping[str, EngineTokenizer] | None = None,
        kv_role: str = "both",
    ) -> None:
        self.params = params
        self.kv_role = kv_role
        self.kv_engine_id = uuid.uuid4().hex
        self.kv_address: tuple[str, int] = ("127.0.0.1", 0)  # set once the listener is bound
        self.model: EngineModel[asyncio.Future[Admitted[Any]]] = EngineModel(params)
        self.publisher = publisher
        self.metrics = metrics
        self.model_name = model_name
        self.adapters = {name: lora_id for lora_id, name in (adapters or {}).items()}
        self.tokenizers = dict(tokenizers or {})
        self.write_lora_name = "lora_name" in publisher.format.stored_fields
        self.created = int(time.time())
        self.requests_served = 0

    # -- routes -----------------------------------------------------------------------------------

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post(RESET_PATH, self._reset)
        app.router.add_post(MATCH_PATH, self._match)

    def _adapter(self, model: Any) -> str:
        """``""`` for the base model, the adapter name for a LoRA adapter; 404 otherwise."""
        if model == self.model_name:
            return ""
        if isinstance(model, str) and model in self.adapters:
            return model
        raise _Error(404, f"The model `{model}` does not exist.", "NotFoundError")

    async def _json(self, request: web.Request) -> dict[str, Any]:
        try:
            data = await request.json(loads=json.loads)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise _Error(400, f"request body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise _Error(400, "request body must be a JSON object")
        return data

    async def _models(self, _request: web.Request) -> web.Response:
        def entry(mid: str, parent: str | None) -> dict[str, Any]:
            return {"id": mid, "object": "model", "created": self.created, "owned_by": "vllm",
                    "root": mid, "parent": parent, "max_model_len": None}

        data = [entry(self.model_name, None)]
        data += [entry(a, self.model_name) for a in sorted(self.adapters)]
        return web.json_response({"object": "list", "data": data})

    async def _reset(self, _request: web.Request) -> web.Response:
        self.model.reset_cache()
        self.publisher.clear()
        self.publisher.end_step()
        self.metrics.kv_cache_usage.set(self.model.usage())
        log.info("prefix cache reset")
        return web.Response(text="")

    async def _match(self, request: web.Request) -> web.Response:
        try:
            data = await self._json(request)
            adapter = self._adapter(data.get("model"))
            tokens = data.get("tokens")
            if not isinstance(tokens, list) or not all(
                type(t) is int and 0 <= t <= 0xFFFFFFFF for t in tokens
            ):
                raise _Error(400, "'tokens' must be a list of token ids")
        except _Error as e:
            return e.response()
        cache = self.model.cache
        matched = cache.match(cache.chain(tokens, adapter)) * cache.block_size
        return web.json_response({"matched_tokens": matched})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    # -- generation -------------------------------------------------------------------------------

    def _prompt(self, data: dict[str, Any], chat: bool) -> list[int]:
        tok = self.tokenizers.get(self.model_name)
        try:
            ids = chat_prompt_ids(tok, data) if chat else completion_prompt_ids(tok, data)
        except PromptError as e:
            raise _Error(400, str(e)) from None
        except UnsupportedPrompt as e:
            raise _Error(400, f"cannot tokenize this prompt: {e} (send token ids, or start "
                         "the engine with --tokenizer-dir)") from None
        if not ids:
            raise _Error(400, "the prompt is empty")
        return ids

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            data = await self._json(request)
            model = data.get("model")
            adapter = self._adapter(model)
            tokens = self._prompt(data, chat)
            max_tokens = data.get("max_completion_tokens" if chat else "max_tokens")
            if max_tokens is None and chat:
                max_tokens = data.get("max_tokens")
            if max_tokens is None:
                max_tokens = DEFAULT_MAX_TOKENS
            if type(max_tokens) is not int or max_tokens < 1:
                raise _Error(400, "max_tokens must be a positive integer")
            stream = data.get("stream") is True
            kv_out = self._kv_transfer(data.get("kv_transfer_params"), len(tokens), stream)
            try:
                self.model.check(tokens)
            except ValueError as e:
                raise _Error(400, str(e)) from None
        except _Error as e:
            return e.response()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Admitted[Any]] = loop.create_future()
        self.model.submit(fut, tokens, adapter, max_tokens, loop.time())
        self._pump()
        admitted = False
        try:
            adm = await fut
            admitted = True
            return await self._respond(
                request, data, adm, str(model), chat, stream, max_tokens, kv_out
            )
        finally:
            if admitted:
                self.model.finish()
            else:
                self.model.cancel(fut)
            self._pump()

    def _kv_transfer(self, kv: Any, n_tokens: int, stream: bool) -> dict[str, Any] | None:
        """Check a request's NIXL-style ``kv_transfer_params`` against ``--kv-role`` and count
        the handoff; returns the params the response carries for the decode side (prefill
        requests), else None. A misrouted handoff is a 400, so it cannot pass unnoticed."""
        if kv is None:
            return None
        if not isinstance(kv, dict):
            raise _Error(400, "kv_transfer_params must be an object")
        if kv.get("do_remote_decode") is True:
            if self.kv_role == "decode":
                raise _Error(400, "this engine only decodes (--kv-role decode)")
            if stream:
                raise _Error(400, "a prefill for a remote decode must not stream")
            self.metrics.kv_transfers.labels("producer", "").inc()
            host, port = self.kv_address
            return {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": self.kv_engine_id,
                "remote_block_ids": list(range(n_tokens // self.params.block_size)),
                "remote_host": host,
                "remote_port": port,
                "tp_size": 1,
            }
        if kv.get("do_remote_prefill") is True:
            if self.kv_role == "prefill":
                raise _Error(400, "this engine only prefills (--kv-role prefill)")
            peer = kv.get("remote_engine_id")
            if not isinstance(peer, str) or not isinstance(kv.get("remote_block_ids"), list):
                raise _Error(400, "kv_transfer_params: remote_engine_id and remote_block_ids "
                             "are required to pull a remote prefill")  # fmt: skip
            self.metrics.kv_transfers.labels("consumer", peer).inc()
        return None

    def _pump(self) -> None:
        """Admit what fits; publish each admission's events and wake its handler."""
        loop = asyncio.get_running_loop()
        for adm in self.model.schedule(loop.time()):
            self._publish(adm)
            fut = adm.key
            if not fut.done():
                fut.set_result(adm)
        m = self.metrics
        m.running.set(self.model.running)
        m.waiting.set(self.model.num_waiting)

    def _publish(self, adm: Admitted[Any]) -> None:
        m = self.metrics
        m.prefix_cache_queries.inc(adm.prompt_tokens)
        m.prefix_cache_hits.inc(adm.hit_tokens)
        m.kv_cache_usage.set(self.model.usage())
        adapter = adm.adapter
        self.publisher.publish_inserted(
            adm.inserted,
            self.params.block_size,
            lora_id=self.adapters.get(adapter) if adapter else None,
            lora_name=adapter if adapter and self.write_lora_name else None,
        )
        self.publisher.end_step()

    async def _respond(
        self,
        request: web.Request,
        data: dict[str, Any],
        adm: Admitted[Any],
        model: str,
        chat: bool,
        stream: bool,
        max_tokens: int,
        kv_out: dict[str, Any] | None = None,
    ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        usage = {
            "prompt_tokens": adm.prompt_tokens,
            "total_tokens": adm.prompt_tokens + max_tokens,
            "completion_tokens": max_tokens,
            "prompt_tokens_details": {"cached_tokens": adm.hit_tokens},
        }
        await asyncio.sleep(max(0.0, adm.first_token_at - loop.time()))
        self.requests_served += 1
        if not stream:
            await asyncio.sleep(max(0.0, adm.finish_at - loop.time()))
            text = _text(max_tokens)
            if chat:
                choice: dict[str, Any] = {
                    "index": 0, "message": {"role": "assistant", "content": text},
                    "logprobs": None, "finish_reason": "length", "stop_reason": None,
                }
            else:
                choice = {"index": 0, "text": text, "logprobs": None,
                          "finish_reason": "length", "stop_reason": None}
            out = {
                "id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": created, "model": model, "choices": [choice], "usage": usage,
            }  # fmt: skip
            if kv_out is not None:
                out["kv_transfer_params"] = kv_out
            return web.json_response(out)
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str, finish: str | None, first: bool = False) -> bytes:
            if chat:
                delta: dict[str, Any] = {"content": text}
                if first:
                    delta["role"] = "assistant"
                choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                          "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            body = {"id": rid, "object": obj, "created": created, "model": model,
                    "choices": [choice]}
            return b"data: " + json.dumps(body).encode() + b"\n\n"

        await resp.write(chunk(_text(1), "length" if max_tokens == 1 else None, True))
        if max_tokens > 1:
            await asyncio.sleep(max(0.0, adm.finish_at - loop.time()))
            await resp.write(chunk(_text(max_tokens - 1), "length"))
        opts = data.get("stream_options")
        if isinstance(opts, dict) and opts.get("include_usage") is True:
            body = {"id": rid, "object": obj, "created": created, "model": model,
                    "choices": [], "usage": usage}
            await resp.write(b"data: " + json.dumps(body).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _text(n: int) -> str:
    """``n`` output tokens of filler text (the simulated engine computes nothing)."""
    return " x" * n


async def serve(
    s: FakeEngineSettings,
    http_sock: socket.socket,
    tokenizers: Mapping[str, EngineTokenizer] | None = None,
) -> int:
    """Run the simulated engine on ``http_sock`` (bound by the caller, ``--http-address``) until
    SIGINT/SIGTERM. ``BindError`` (nothing logged, nothing left open) when the publisher's
    endpoints cannot be bound."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    toks = dict(tokenizers or {})
    ctx = zmq.asyncio.Context()
    publisher = EventPublisher.from_settings(ctx, s)
    metrics = EngineMetrics(s.model_name, block_size=s.block_size)
    engine = SimulatedEngine(
        EngineParams.from_flags(s),
        publisher,
        metrics,
        model_name=s.model_name,
        adapters=parse_adapter_names(s.lora_adapters),
        tokenizers=toks,
        kv_role=s.kv_role,
    )
    app = web.Application(client_max_size=MAX_BODY, middlewares=[guard_middleware(metrics.drops)])
    MetricsPage(metrics).routes(app)
    engine.routes(app)
    listener = Listener(app)
    try:
        publisher.start()
        port = await listener.start_socket(http_sock)
    except BaseException:
        await publisher.close()
        ctx.destroy(linger=0)
        raise
    http = f"{parse_host_port(s.http_address).host}:{port}"
    engine.kv_address = (parse_host_port(s.http_address).host, port)
    p = engine.params
    log.info(
        "simulated engine ready",
        extra={
            "endpoint": publisher.endpoint,
            "replay_endpoint": publisher.replay_endpoint,
            "http_address": http,
            "model_name": s.model_name,
            "adapters": sorted(engine.adapters),
            "block_size": p.block_size,
            "gpu_blocks": p.num_blocks,
            "max_num_seqs": p.max_num_seqs,
            "prefill_ms_per_token": p.prefill_ms_per_token,
            "decode_ms_per_token": p.decode_ms_per_token,
            "tokenizers": sorted(toks),
            "kv_role": engine.kv_role,
            "kv_engine_id": engine.kv_engine_id,
        },
    )
    await stop.wait()
    with contextlib.suppress(Exception):
        await listener.stop()
    await publisher.close()
    ctx.destroy(linger=0)
    log.info(
        "simulated engine stopped",
        extra={"requests": engine.requests_served, "batches": publisher.batches_published},
    )
    return 0

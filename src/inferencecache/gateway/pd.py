"""The gateway's P/D mode (``--pd-topology NAME``, docs/gateway.md): ask LookupPDRoute which
prefill and decode replicas to use, then hand the request over the way vLLM's disaggregated
prefill proxies do with the NIXL connector.

The handoff convention (vLLM ``kv_transfer_params``, NixlConnector / P2P connectors):

1. prefill: the client's body with ``kv_transfer_params = {do_remote_decode: true,
   do_remote_prefill: false, remote_*: null}``, ``stream: false``, ``max_tokens: 1`` (and
   ``max_completion_tokens: 1`` when present), ``stream_options`` removed, sent to the prefill
   replica; its JSON answer carries the ``kv_transfer_params`` the decode side needs
   (``remote_engine_id``, ``remote_block_ids``, ``remote_host``, ``remote_port``, ...).
2. decode: the client's original body plus those ``kv_transfer_params``, sent to the decode
   replica; its answer (streamed or not) goes back to the client.

Anything missing (no answer, a code without both replicas, an unhealthy replica, a failed
prefill) falls back to the gateway's ordinary single-engine routing: a vLLM instance with a
NIXL connector serves a request without ``kv_transfer_params`` locally, so this never fails a
request that plain routing would have served.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Final

import aiohttp
import grpc
import grpc.aio

from inferencecache import fingerprint
from inferencecache.channels import PLAINTEXT, ChannelSecurity, FollowedChannel
from inferencecache.gateway.hints import CHANNEL_OPTIONS
from inferencecache.routing import reasons
from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from inferencecache.v1alpha1 import inferencecache_pb2_grpc as pb_grpc

log = logging.getLogger("inferencecache.gateway")

PREFILL_KV_PARAMS: Final = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
MAX_PREFILL_ANSWER: Final = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class PDAnswer:
    """LookupPDRoute's answer, or a gateway-side code (``HINT_ERROR``, ``HINT_TIMEOUT``,
    ``HINT_SKIPPED``) with no replicas."""

    reason_code: str
    prefill: str = ""
    decode: str = ""
    transport: str = ""


def prefill_body(data: dict[str, Any]) -> bytes:
    """The prefill request of step 1 from the client's decoded body."""
    body = dict(data)
    body["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    body["stream"] = False
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body.pop("stream_options", None)
    return json.dumps(body).encode()


def decode_body(data: dict[str, Any], kv: dict[str, Any]) -> bytes:
    """The decode request of step 2: the client's body plus the prefill's transfer params."""
    return json.dumps({**data, "kv_transfer_params": kv}).encode()


class PDClient:
    """LookupPDRoute over one ``grpc.aio`` channel; never raises."""

    def __init__(
        self, target: str, timeout: float, topology: str, security: ChannelSecurity = PLAINTEXT
    ) -> None:
        self.target = target
        self.timeout = timeout
        self.topology = topology
        self.security = security
        self._followed: FollowedChannel | None = None
        self._channel: grpc.aio.Channel | None = None
        self._call: Any = None
        self._last_error = 0.0

    async def start(self) -> None:
        self._followed = FollowedChannel(self.target, self.security, CHANNEL_OPTIONS,
                                         grace=self.timeout)  # fmt: skip
        self._bind(self._followed.channel)

    def _bind(self, channel: grpc.aio.Channel) -> None:
        self._channel = channel
        stub = pb_grpc.InferenceCacheStub(channel)  # type: ignore[no-untyped-call]
        self._call = stub.LookupPDRoute

    async def close(self) -> None:
        if self._followed is not None:
            await self._followed.close()
            self._followed = self._channel = None

    async def route(self, tenant: str, model: str, chain: bytes, block_size: int) -> PDAnswer:
        """LookupPDRoute for the prompt's fingerprint chain (its last block hash names the
        whole prefix, contract-and-index.md §8.1)."""
        n = len(chain) // fingerprint.HASH_BYTES
        if self._call is None:
            return PDAnswer(reasons.HINT_SKIPPED)
        req = pb.LookupPDRouteRequest(
            model_id=model,
            tenant_id=tenant,
            prefix_hash=chain[-fingerprint.HASH_BYTES :] if n else b"",
            prefix_token_count=n * block_size,
            pd_topology_ref=self.topology,
        )
        try:
            followed = self._followed
            if followed is not None and followed.current() is not self._channel:
                self._bind(followed.channel)  # renewed TLS files: a new channel
            resp = await self._call(req, timeout=self.timeout, metadata=self.security.metadata())
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return PDAnswer(reasons.HINT_TIMEOUT)
            if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                self._log(f"{e.code().name}: {e.details()} (the server refused the gateway's "
                          "credential: check --auth-token-file, the TLS flags and the "
                          "credential's tenants)")  # fmt: skip
                return PDAnswer(reasons.HINT_ERROR)
            self._log(f"{e.code().name}: {e.details()}")
            return PDAnswer(reasons.HINT_ERROR)
        except Exception as e:  # never fail a request because of the hint plane
            self._log(f"{type(e).__name__}: {e}")
            return PDAnswer(reasons.HINT_ERROR)
        return PDAnswer(
            resp.reason_code, resp.prefill_replica_id, resp.decode_replica_id, resp.transport_hint
        )

    def _log(self, err: str) -> None:
        now = time.monotonic()
        if now - self._last_error >= 10.0:
            self._last_error = now
            log.warning(
                "LookupPDRoute failed; routing to one engine (logged at most every 10s)",
                extra={"server": self.target, "err": err},
            )


async def run_prefill(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: list[tuple[str, str]]
) -> tuple[str, dict[str, Any] | None]:
    """Step 1 on one engine: (outcome, the decode side's kv_transfer_params or None). The
    outcome names a failure for the metrics (``ok``, ``connect``, ``status``, ``answer``)."""
    try:
        async with session.post(url, data=body, headers=headers) as up:
            if up.status != 200:
                return "status", None
            if (up.content_length or 0) > MAX_PREFILL_ANSWER:
                return "answer", None
            raw = await up.read()
    except (aiohttp.ClientError, TimeoutError):
        return "connect", None
    try:
        answer = json.loads(raw) if len(raw) <= MAX_PREFILL_ANSWER else None
    except ValueError:
        answer = None
    kv = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if not isinstance(kv, dict):
        return "answer", None
    return "ok", kv

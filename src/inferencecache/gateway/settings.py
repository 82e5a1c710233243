"""``inferencecache gateway`` settings: one flag per field, each also ``INFERENCECACHE_<FLAG>``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

import click

from inferencecache.channels import (
    ChannelSecurity,
    auth_token_file_setting,
    tls_ca_file_setting,
    tls_cert_file_setting,
    tls_key_file_setting,
)
from inferencecache.config import (
    DURATION,
    GO_BOOL,
    HOST_PORT,
    HostPort,
    log_level_setting,
    setting,
)
from inferencecache.routing.model import RoutingPolicy
from inferencecache.routing.registry import POLICY_NAMES, guard_params, make_policy, parse_params
from inferencecache.server.settings import DEFAULT_GRPC_ADDRESS

DEFAULT_HTTP_ADDRESS: Final = HostPort("127.0.0.1", 8090)
DEFAULT_SERVER: Final = DEFAULT_GRPC_ADDRESS
_HEADER: Final = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")


@dataclass(frozen=True)
class EngineSpec:
    """One upstream engine: its replica id (= the subscriber's ``--replica-id``) and base URL."""

    replica_id: str
    url: str  # scheme://host:port[/path prefix], no trailing slash


def parse_engines(text: str) -> list[EngineSpec]:
    """``"r0=http://127.0.0.1:8001,r1=http://127.0.0.1:8002"``; ValueError names the bad item."""
    out: list[EngineSpec] = []
    seen: set[str] = set()
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        rid, sep, url_text = item.partition("=")
        rid, url_text = rid.strip(), url_text.strip()
        if not sep or not rid or not url_text:
            raise ValueError(f"item {item!r} is not replica_id=http://host:port")
        try:
            parts = urlsplit(url_text)
            parts.port  # noqa: B018 (an out-of-range port raises here)
        except ValueError:
            raise ValueError(f"item {item!r}: {url_text!r} is not a URL with a port") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"item {item!r}: want an http:// or https:// URL with a host")
        if parts.query or parts.fragment or parts.username or parts.password:
            raise ValueError(f"item {item!r}: the URL must not carry a query, fragment or user")
        if rid in seen:
            raise ValueError(f"duplicate replica id {rid!r}")
        seen.add(rid)
        out.append(EngineSpec(rid, f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"))
    if not out:
        raise ValueError("no engines given (want e.g. r0=http://127.0.0.1:8000)")
    return out


def parse_adapters(text: str) -> dict[str, str]:
    """``"sql-lora=tiny,chat-lora=tiny"`` (LoRA adapter = base model id) -> {adapter: base}."""
    out: dict[str, str] = {}
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        name, sep, base = item.partition("=")
        name, base = name.strip(), base.strip()
        if not sep or not name or not base:
            raise ValueError(f"item {item!r} is not adapter=base_model")
        if name in out:
            raise ValueError(f"duplicate adapter {name!r}")
        out[name] = base
    return out


@dataclass(frozen=True)
class GatewaySettings:
    """Everything ``gateway`` reads from flags and the environment (docs/gateway.md has it)."""

    engines: str = setting(
        "",
        required=True,
        help='Upstream engines as replica_id=URL, comma separated: "r0=http://127.0.0.1:8001,'
        'r1=http://127.0.0.1:8002". Replica ids must equal the subscribers\' --replica-id.',
        metavar="ID=URL,...",
    )
    http_address: HostPort = setting(  # noqa: RUF009 (HostPort is frozen)
        DEFAULT_HTTP_ADDRESS, param=HOST_PORT, help="HTTP listen address (OpenAI API, /metrics)."
    )
    server: HostPort = setting(  # noqa: RUF009
        DEFAULT_SERVER, param=HOST_PORT, help="Server gRPC address for LookupRoute."
    )
    lookup_url: str = setting(
        "",
        help="Base URL of the server's HTTP lookup listener (serve --lookup-http-address), e.g. "
        "http://127.0.0.1:8081: hints over HTTP/1.1 keep-alive, the cheaper path; empty: gRPC "
        "on --server.",
        metavar="URL",
    )
    lookup_timeout: float = setting(
        0.05, param=DURATION, help="LookupRoute deadline; on expiry the request is routed anyway."
    )
    event_log: str = setting(
        "",
        help="Ask a replica of the shared event log held in this process instead of --server "
        "(redis://HOST:PORT/DB, as serve --event-log): no gRPC hop per request.",
        metavar="URL",
    )
    event_log_key: str = setting(
        "inferencecache", help="Key prefix of the event log in Redis (as serve's)."
    )
    routing_policy: str = setting(
        "cache_aware",
        param=click.Choice(POLICY_NAMES),
        help="How to pick an engine (docs/gateway.md).",
    )
    routing_params: str = setting(
        "",
        help='Policy parameters, e.g. "capacity_blocks=4096" for approximate. They override the '
        "load guard the prefix-aware policies run with by default (docs/gateway.md; "
        '"balance_abs_threshold=0" turns it off).',
        metavar="K=V,...",
    )
    pd_topology: str = setting(
        "",
        help="P/D mode: the server's prefill/decode topology to route in (LookupPDRoute); each "
        "request is prefilled on its prefill replica and decoded on its decode replica with "
        "vLLM's kv_transfer_params (docs/gateway.md). Empty: off.",
        metavar="NAME",
    )
    tenant_header: str = setting("X-Tenant-Id", help="Request header naming the tenant.")
    tenant_id: str = setting("default", help="Tenant when the header is absent or empty.")
    hash_scheme: str = setting("vllm", help="Hash scheme of the fingerprint chain.")
    block_size: int = setting(
        16, help="Tokens per fingerprint block; must equal the engines', subscribers', server's."
    )
    tokenizer_dir: str = setting(
        "",
        help="Directory of <model_id>/tokenizer.json (+ tokenizer_config.json), as serve's. "
        "Unset: only token-list prompts are fingerprinted.",
        metavar="DIR",
    )
    adapters: str = setting(
        "",
        help='LoRA adapters as adapter=base_model: "sql-lora=tiny". Added to the ones '
        "discovered from the engines' /v1/models.",
        metavar="NAME=BASE,...",
    )
    discover_models: bool = setting(
        True,
        param=GO_BOOL,
        help="Read each engine's /v1/models (models it serves; LoRA adapters and their parent).",
    )
    health_interval: float = setting(
        5.0, param=DURATION, help="How often a healthy engine's /health is probed."
    )
    health_timeout: float = setting(1.0, param=DURATION, help="Deadline of one health probe.")
    health_backoff_max: float = setting(
        10.0, param=DURATION, help="Longest wait between probes of an engine that is down."
    )
    connect_timeout: float = setting(
        2.0, param=DURATION, help="Deadline to connect to an engine (then another is tried)."
    )
    upstream_timeout: float = setting(
        600.0,
        param=DURATION,
        help="Longest silence from an engine (before its headers: 504; mid-stream: abort).",
    )
    oracle_timeout: float = setting(
        0.5, param=DURATION, help="Deadline of the oracle policy's per-engine cache query."
    )
    max_body_bytes: int = setting(
        32 * 1024 * 1024, help="Largest request body accepted (larger: 413)."
    )
    auth_token_file: str = auth_token_file_setting()
    tls_ca_file: str = tls_ca_file_setting()
    tls_cert_file: str = tls_cert_file_setting()
    tls_key_file: str = tls_key_file_setting()
    log_level: str = log_level_setting()

    def __post_init__(self) -> None:
        ChannelSecurity.of(self).check_flags()
        try:
            parse_engines(self.engines)
        except ValueError as e:
            raise ValueError(f"--engines: {e}") from None
        try:
            parse_adapters(self.adapters)
        except ValueError as e:
            raise ValueError(f"--adapters: {e}") from None
        try:
            self.build_policy()
        except ValueError as e:
            raise ValueError(f"--routing-params: {e}") from None
        if self.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {self.block_size}")
        if not self.hash_scheme:
            raise ValueError("--hash-scheme must not be empty")
        if self.lookup_url and self.event_log:
            raise ValueError("give --lookup-url or --event-log, not both (two hint sources)")
        if self.lookup_url:
            url = urlsplit(self.lookup_url)
            if url.scheme != "http" or not url.hostname or url.path not in ("", "/"):
                raise ValueError(
                    f"--lookup-url {self.lookup_url!r}: give http://HOST:PORT (the server's "
                    "--lookup-http-address)"
                )
        if not _HEADER.match(self.tenant_header):
            raise ValueError(f"--tenant-header: {self.tenant_header!r} is not a header name")
        if not self.tenant_id:
            raise ValueError("--tenant-id must not be empty")
        if self.max_body_bytes < 1024:
            raise ValueError(f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")
        for flag in (
            "lookup_timeout",
            "health_interval",
            "health_timeout",
            "health_backoff_max",
            "connect_timeout",
            "upstream_timeout",
            "oracle_timeout",
        ):
            if getattr(self, flag) <= 0:
                raise ValueError(f"--{flag.replace('_', '-')} must be > 0")

    @property
    def engine_specs(self) -> list[EngineSpec]:
        return parse_engines(self.engines)

    @property
    def adapter_bases(self) -> dict[str, str]:
        return parse_adapters(self.adapters)

    @property
    def policy_params(self) -> dict[str, Any]:
        """The parameters ``--routing-params`` names (only those)."""
        return parse_params(self.routing_params, self.routing_policy)

    @property
    def effective_policy_params(self) -> dict[str, Any]:
        """What the policy is built with: the deployed load guard (``guard_params``: on for
        ``cache_aware``, ``oracle`` and ``approximate``), overridden by ``--routing-params``."""
        return {**guard_params(self.routing_policy), **self.policy_params}

    def build_policy(self) -> RoutingPolicy:
        """A fresh policy as configured (ValueError for bad parameters)."""
        return make_policy(self.routing_policy, **self.effective_policy_params)

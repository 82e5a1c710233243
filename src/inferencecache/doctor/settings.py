"""Flags of ``inferencecache doctor``: where the server, subscribers, gateways and engine are.

Everything but the server is optional: a check whose inputs were not given says ``SKIP``.
Every flag is also ``INFERENCECACHE_<FLAG>``; a malformed value exits 2 with one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from inferencecache.channels import (
    ChannelSecurity,
    auth_token_file_setting,
    tls_ca_file_setting,
    tls_cert_file_setting,
    tls_key_file_setting,
)
from inferencecache.config import DURATION, HOST_PORT, ZMQ_ENDPOINT, HostPort, setting
from inferencecache.server.settings import DEFAULT_GRPC_ADDRESS


def check_base_url(flag: str, url: str) -> str:
    """``url`` without a trailing slash; ``ValueError`` naming ``flag`` unless it is an
    http(s) URL with a host (and a valid port), no query or fragment."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (an out-of-range port raises here)
    except ValueError:
        raise ValueError(f"{flag}: {url!r} has a bad port") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{flag}: {url!r} is not an http:// or https:// URL with a host")
    if parts.query or parts.fragment or any(c.isspace() for c in url):
        raise ValueError(f"{flag}: {url!r} must be a base URL (no query, fragment or spaces)")
    return url.rstrip("/")


def split_urls(flag: str, text: str) -> tuple[str, ...]:
    """A comma-separated list of base URLs (empty items skipped), each checked."""
    return tuple(check_base_url(flag, u.strip()) for u in text.split(",") if u.strip())


@dataclass(frozen=True)
class DoctorSettings:
    """Flags of ``inferencecache doctor``."""

    server: HostPort = setting(  # noqa: RUF009 (HostPort is frozen)
        DEFAULT_GRPC_ADDRESS, param=HOST_PORT, help="Server gRPC address."
    )
    server_http: str = setting(
        "http://127.0.0.1:8080",
        help="Server HTTP base URL (/healthz, /readyz, /metrics).",
        metavar="URL",
    )
    admin_url: str = setting(
        "",
        help="Base URL of the server's /snapshot and /probe (serve --admin-address); "
        '"" = --server-http.',
        metavar="URL",
    )
    admin_token_file: str = setting(
        "", help="File with the server's admin bearer token (serve --admin-token-file).",
        metavar="PATH",
    )
    subscribers: str = setting(
        "",
        help="Subscriber metrics base URLs, comma separated (subscribe --metrics-address).",
        metavar="URLS",
    )
    gateways: str = setting(
        "", help="Gateway base URLs, comma separated (gateway --http-address).", metavar="URLS"
    )
    engine_url: str = setting(
        "",
        help="An engine's HTTP base URL (its /metrics and /v1/models), e.g. http://127.0.0.1:8000.",
        metavar="URL",
    )
    engine_endpoint: str = setting(
        "", param=ZMQ_ENDPOINT, help='That engine\'s KV-event PUB endpoint ("" = not checked).'
    )
    replay_endpoint: str = setting(
        "",
        param=ZMQ_ENDPOINT,
        help="That engine's replay ROUTER endpoint: recent batches even from an idle engine.",
    )
    events_wait: float = setting(
        3.0, param=DURATION, help="How long to listen to --engine-endpoint."
    )
    max_event_age: float = setting(
        300.0,
        param=DURATION,
        help="A replica whose newest event and stats report are older than this fails.",
    )
    model_id: str = setting(
        "", help='Model of the probe (default: the first subscriber\'s --model-id, else "doctor").'
    )
    hash_scheme: str = setting(
        "", help='Hash scheme of the probe (default: the subscribers\', else "vllm").'
    )
    timeout: float = setting(5.0, param=DURATION, help="Deadline of each request.")
    auth_token_file: str = auth_token_file_setting()
    tls_ca_file: str = tls_ca_file_setting()
    tls_cert_file: str = tls_cert_file_setting()
    tls_key_file: str = tls_key_file_setting()

    def __post_init__(self) -> None:
        ChannelSecurity.of(self).check_flags()
        check_base_url("--server-http", self.server_http)
        if self.admin_url:
            check_base_url("--admin-url", self.admin_url)
        if self.engine_url:
            check_base_url("--engine-url", self.engine_url)
        split_urls("--subscribers", self.subscribers)
        split_urls("--gateways", self.gateways)
        if self.replay_endpoint and not self.engine_endpoint:
            raise ValueError("--replay-endpoint needs --engine-endpoint")
        for flag, value in (
            ("--timeout", self.timeout),
            ("--events-wait", self.events_wait),
            ("--max-event-age", self.max_event_age),
        ):
            if value <= 0:
                raise ValueError(f"{flag} must be > 0")

    @property
    def subscriber_urls(self) -> tuple[str, ...]:
        return split_urls("--subscribers", self.subscribers)

    @property
    def gateway_urls(self) -> tuple[str, ...]:
        return split_urls("--gateways", self.gateways)

    @property
    def admin_base(self) -> str:
        return (self.admin_url or self.server_http).rstrip("/")

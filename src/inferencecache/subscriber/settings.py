"""Settings of ``inferencecache subscribe`` (engine-events-and-subscriber.md §8): one frozen
dataclass.

Every flag also reads ``INFERENCECACHE_<FLAG>``; the command line wins. Cross-field and value
checks raise ``ValueError`` in ``__post_init__``, which the CLI turns into one line and exit 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final
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
    GO_INT,
    HOST_PORT,
    ZMQ_ENDPOINT,
    HostPort,
    log_level_setting,
    setting,
)
from inferencecache.subscriber.lora import parse_adapter_names
from inferencecache.subscriber.refresh import DEFAULT_INTERVAL, LIVENESS_PROBES

CACHE_TIERS: Final = ("auto", "kv", "gpu", "cpu")
DEFAULT_WINDOW: Final = 0.1
DEFAULT_STATS_INTERVAL: Final = 10.0
DEFAULT_ADAPTER_POLL_INTERVAL: Final = 10.0

DEFAULT_SERVER: Final = HostPort("127.0.0.1", 9090)
DEFAULT_METRICS_ADDRESS: Final = HostPort("127.0.0.1", 9091)

def check_metrics_url(url: str, flag: str = "--engine-metrics-url") -> None:
    """``ValueError`` naming ``flag`` unless ``url`` is http(s)://host[:port]..."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (a bad or out-of-range port raises here)
    except ValueError:
        raise ValueError(f"{flag}: {url!r} has a bad port") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{flag}: {url!r} is not an http:// or https:// URL with a host")
    if any(c.isspace() for c in url):
        raise ValueError(f"{flag}: {url!r} contains whitespace")


@dataclass(frozen=True)
class SubscribeSettings:
    """Flags of ``inferencecache subscribe``."""

    replica_id: str = setting("", required=True, help="Replica identity (sidecar: pod name).")
    model_id: str = setting("", required=True, help="Served model id (an index key).")
    replica_role: str = setting(
        "both",
        param=click.Choice(["prefill", "decode", "both"]),
        help="The engine's role in a disaggregated prefill/decode fleet. A label only (on "
        "inferencecache_subscriber_info and the startup log): the server's --pd-topology-file "
        "decides roles, since no contract field carries one.",
    )
    engine_endpoint: str = setting(
        "tcp://127.0.0.1:5557", param=ZMQ_ENDPOINT, help="Engine PUB endpoint to connect to."
    )
    topic: str = setting("", help='SUB prefix filter; "" receives every topic.')
    server: HostPort = setting(  # noqa: RUF009 - setting() returns a dataclasses.field
        DEFAULT_SERVER, param=HOST_PORT, help="Server gRPC address (plaintext)."
    )
    tenant_id: str = setting("default", help="Tenant (sidecar: pod namespace).")
    hash_scheme: str = setting(
        "vllm", help="Hash scheme stamped on every report; 'sglang' selects the SGLang stats."
    )
    window: float = setting(
        DEFAULT_WINDOW, param=DURATION, help="Add debounce window (<=0: 100ms)."
    )
    engine_metrics_url: str = setting(
        "http://127.0.0.1:8000/metrics",
        help='Engine Prometheus URL (http:// or https://) for stats ("" disables).',
        metavar="URL",
    )
    stats_interval: float = setting(
        DEFAULT_STATS_INTERVAL, param=DURATION, help="Stats cadence (<=0: 10s)."
    )
    engine_cache_size_bytes: int = setting(
        0, param=GO_INT, help="Engine KV capacity in bytes, for cache_memory_bytes."
    )
    max_concurrency_ceiling: int = setting(
        256, param=GO_INT, help="Running+waiting requests that count as pressure 1."
    )
    cache_tier: str = setting("auto", help="Usage gauge: auto, kv, gpu or cpu.")
    engine_model_name: str = setting("", help='model_name label filter ("" = all series).')
    ignore_block_removed: bool = setting(
        False, param=GO_BOOL, help="Replica has an invisible L2 tier: GPU removals become T2."
    )
    lora_adapter_names: str = setting("", help='LoRA id=name table, e.g. "1=sql-lora,2=chat".')
    block_size: int = setting(
        16, param=GO_INT, help="Engine block (SGLang page) size; must equal the server's."
    )
    replay_endpoint: str = setting(
        "", param=ZMQ_ENDPOINT, help='Engine replay ROUTER endpoint ("" disables replay).'
    )
    trust_lora_name: bool = setting(
        True, param=GO_BOOL, help="Use an event's lora_name as the adapter identity."
    )
    metrics_address: HostPort = setting(  # noqa: RUF009 - setting() returns a field
        DEFAULT_METRICS_ADDRESS, param=HOST_PORT, help="host:port for /metrics and /healthz."
    )
    batch_evictions: bool = setting(
        True,
        param=GO_BOOL,
        help="Send the evictions of a batch as one PublishEvent (prefix_hashes, field 8); "
        "=false: one PublishEvent per evicted block.",
    )
    refresh_interval: float = setting(
        DEFAULT_INTERVAL,
        param=DURATION,
        help="Re-report every resident block once per this interval, spread evenly, while the "
        "engine is alive, so live blocks never expire from the index (keep it <= the server's "
        "TTL / 3; 0 disables).",
    )
    engine_models_url: str = setting(
        "http://127.0.0.1:8000/v1/models",
        help="Engine OpenAI /v1/models URL, polled to drop the blocks of unloaded LoRA adapters "
        '("" disables).',
        metavar="URL",
    )
    adapter_poll_interval: float = setting(
        DEFAULT_ADAPTER_POLL_INTERVAL, param=DURATION,
        help="How often --engine-models-url is polled (<=0: 10s).",
    )
    auth_token_file: str = auth_token_file_setting()
    tls_ca_file: str = tls_ca_file_setting()
    tls_cert_file: str = tls_cert_file_setting()
    tls_key_file: str = tls_key_file_setting()
    log_level: str = log_level_setting()

    def __post_init__(self) -> None:
        ChannelSecurity.of(self).check_flags()
        if not self.replica_id:
            raise ValueError("missing --replica-id")
        if not self.model_id:
            raise ValueError("missing --model-id")
        if not self.hash_scheme:
            raise ValueError("--hash-scheme must not be empty")
        if self.cache_tier not in CACHE_TIERS:
            raise ValueError(
                f"--cache-tier: invalid value {self.cache_tier!r} (want auto, kv, gpu or cpu)"
            )
        if self.block_size < 1:
            raise ValueError(f"--block-size: must be >= 1, got {self.block_size}")
        try:
            parse_adapter_names(self.lora_adapter_names)
        except ValueError as e:
            raise ValueError(f"--lora-adapter-names: {e}") from None
        if self.engine_metrics_url:
            check_metrics_url(self.engine_metrics_url)
        if self.engine_models_url:
            check_metrics_url(self.engine_models_url, "--engine-models-url")
        if self.refresh_interval < 0:
            raise ValueError(
                f"--refresh-interval: must be >= 0 (0 disables), got {self.refresh_interval}"
            )

    @property
    def adapter_names(self) -> dict[int, str]:
        """The parsed ``--lora-adapter-names`` table (validated at construction)."""
        return parse_adapter_names(self.lora_adapter_names)

    @property
    def effective_window(self) -> float:
        """The add debounce window; non-positive means the 100 ms default."""
        return self.window if self.window > 0 else DEFAULT_WINDOW

    @property
    def effective_stats_interval(self) -> float:
        """The stats cadence; non-positive means the 10 s default."""
        return self.stats_interval if self.stats_interval > 0 else DEFAULT_STATS_INTERVAL

    @property
    def effective_adapter_poll_interval(self) -> float:
        """The adapter listing cadence; non-positive means the 10 s default."""
        if self.adapter_poll_interval > 0:
            return self.adapter_poll_interval
        return DEFAULT_ADAPTER_POLL_INTERVAL

    @property
    def liveness_window(self) -> float:
        """Seconds without an HTTP answer or an engine event after which an engine whose probes
        used to answer counts as dead: three intervals of the slowest probe configured."""
        probes = []
        if self.engine_metrics_url:
            probes.append(self.effective_stats_interval)
        if self.engine_models_url:
            probes.append(self.effective_adapter_poll_interval)
        return LIVENESS_PROBES * max(probes, default=DEFAULT_STATS_INTERVAL)

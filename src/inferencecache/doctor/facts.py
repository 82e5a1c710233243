"""What ``doctor`` reads: every request it makes, each bounded by ``--timeout``, none raising.

Each reader returns plain data (or the error text of what failed), so the checks in
``checks.py`` are pure functions of it and are tested without sockets.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

Labels = dict[str, str]


@dataclass
class Metrics:
    """One scraped ``/metrics`` page: sample name -> [(labels, value)]."""

    samples: dict[str, list[tuple[Labels, float]]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Metrics:
        out = cls()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out.samples.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
        return out

    def names(self) -> set[str]:
        return set(self.samples)

    def total(self, name: str, **labels: str) -> float | None:
        """Sum of the samples of ``name`` whose labels include ``labels``; None if absent."""
        rows = [v for lab, v in self.samples.get(name, ()) if _has(lab, labels)]
        return sum(rows) if rows else None

    def info(self, name: str) -> Labels | None:
        """The labels of the first sample of ``name`` (an ``*_info`` series)."""
        rows = self.samples.get(name)
        return dict(rows[0][0]) if rows else None

    def prefixed(self, prefix: str) -> bool:
        return any(n.startswith(prefix) for n in self.samples)


def _has(labels: Labels, want: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in want.items())


@dataclass(frozen=True)
class Response:
    """One HTTP exchange: ``status`` is None when no answer came (``error`` says why)."""

    url: str
    status: int | None = None
    body: bytes = b""
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    @property
    def text(self) -> str:
        return self.body.decode(errors="replace")

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            return None

    def problem(self) -> str:
        """One phrase for a failed exchange."""
        if self.status is None:
            return f"{self.url}: {self.error}"
        snippet = " ".join(self.text.split())[:120]
        return f"{self.url}: HTTP {self.status}" + (f" ({snippet})" if snippet else "")


def fetch(
    url: str,
    timeout: float,
    *,
    method: str = "GET",
    body: bytes | None = None,
    token: str | None = None,
) -> Response:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return Response(url, r.status, r.read())
    except urllib.error.HTTPError as e:
        try:
            return Response(url, e.code, e.read())
        finally:
            e.close()
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        return Response(url, error=str(reason) or type(e).__name__)


def scrape(url: str, timeout: float) -> tuple[Response, Metrics | None]:
    """``GET url`` and parse it as Prometheus text (None when unreadable)."""
    resp = fetch(url, timeout)
    if not resp.ok:
        return resp, None
    try:
        return resp, Metrics.parse(resp.text)
    except ValueError as e:
        return Response(url, resp.status, resp.body, f"not Prometheus text: {e}"), None


# ---- per component -------------------------------------------------------------------------


@dataclass
class ServerFacts:
    address: str
    http: str
    grpc_error: str = ""
    health: str = ""  # grpc.health.v1 status name of service ""
    healthz: Response | None = None
    readyz: Response | None = None
    metrics_resp: Response | None = None
    metrics: Metrics | None = None
    snapshot: Response | None = None
    probe: Response | None = None
    probe_ack: str = ""  # "accepted" or the error of ReportCacheState for the probe tenant
    probe_lookup: str = ""  # reason code of LookupRoute for the probe tenant, or the error

    @property
    def grpc_up(self) -> bool:
        return not self.grpc_error

    @property
    def http_up(self) -> bool:
        return self.healthz is not None and self.healthz.status is not None


@dataclass
class SubscriberFacts:
    url: str
    metrics_resp: Response
    metrics: Metrics | None
    healthz: Response | None = None

    @property
    def info(self) -> Labels:
        return (self.metrics.info("inferencecache_subscriber_info") if self.metrics else None) or {}

    @property
    def name(self) -> str:
        rid = self.info.get("replica_id")
        return f"{rid} ({self.url})" if rid else self.url


@dataclass
class GatewayFacts:
    url: str
    metrics_resp: Response
    metrics: Metrics | None
    healthz: Response | None = None

    @property
    def info(self) -> Labels:
        return (self.metrics.info("inferencecache_gateway_info") if self.metrics else None) or {}


@dataclass
class EngineFacts:
    url: str
    metrics_resp: Response
    metrics: Metrics | None
    models: Response | None = None

    @property
    def family(self) -> str:
        """``vllm`` or ``sglang`` from the metric names (the hash scheme they publish)."""
        if self.metrics is None:
            return ""
        for fam in ("vllm", "sglang"):
            if self.metrics.prefixed(fam + ":"):
                return fam
        return ""

    @property
    def block_size(self) -> int | None:
        """vLLM's ``vllm:cache_config_info{block_size}``."""
        info = self.metrics.info("vllm:cache_config_info") if self.metrics else None
        try:
            return int(info["block_size"]) if info and "block_size" in info else None
        except ValueError:
            return None

    def adapters(self) -> list[str] | None:
        """LoRA adapters served (``/v1/models`` entries with a ``parent``), None if unknown."""
        if self.models is None or not self.models.ok:
            return None
        doc = self.models.json()
        data = doc.get("data") if isinstance(doc, dict) else None
        if not isinstance(data, list):
            return None
        return sorted(
            str(m["id"]) for m in data
            if isinstance(m, dict) and m.get("parent") and m.get("id") != m.get("parent")
        )  # fmt: skip

    def served_models(self) -> list[str]:
        doc = self.models.json() if self.models is not None and self.models.ok else None
        data = doc.get("data") if isinstance(doc, dict) else None
        if not isinstance(data, list):
            return []
        return sorted(str(m["id"]) for m in data if isinstance(m, dict) and not m.get("parent"))


@dataclass
class EventSample:
    """What the engine's KV-event endpoints said within ``--events-wait``."""

    endpoint: str
    error: str = ""
    live: int = 0
    replayed: int = 0
    undecodable: int = 0
    stored: int = 0
    block_sizes: set[int] = field(default_factory=set)
    # (lora_id, lora_name) of BlockStored events under an adapter
    adapters: set[tuple[int | None, str | None]] = field(default_factory=set)
    newest_ts: float = 0.0

    @property
    def batches(self) -> int:
        return self.live + self.replayed


def sample_events(endpoint: str, replay: str, wait: float) -> EventSample:
    """Listen to the PUB ``endpoint`` for ``wait`` seconds; with ``replay``, also ask the
    engine's ROUTER for its buffered batches (an idle engine publishes nothing live)."""
    import zmq

    from inferencecache.kvevents import framing
    from inferencecache.kvevents.decode import decode_batch
    from inferencecache.kvevents.events import BlockStored

    out = EventSample(endpoint)
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        dealer = None
        if replay:
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(replay)
            dealer.send_multipart(framing.replay_request(0))
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        if dealer is not None:
            poller.register(dealer, zmq.POLLIN)
        payloads: list[bytes] = []
        deadline = time.monotonic() + wait
        replay_done = dealer is None
        while (left := deadline - time.monotonic()) > 0 and len(payloads) < 20_000:
            for sock, _ in poller.poll(max(1, int(left * 1000))):
                frames = sock.recv_multipart()
                if sock is sub:
                    try:
                        payloads.append(framing.parse_live(frames)[2])
                        out.live += 1
                    except framing.FrameError:
                        out.undecodable += 1
                    continue
                reply = framing.parse_replay_reply(frames)
                if isinstance(reply, framing.ReplayData):
                    payloads.append(reply.payload)
                    out.replayed += 1
                elif isinstance(reply, framing.ReplayEnd):
                    replay_done = True
            if replay_done and out.live:
                break  # live traffic seen and the replay answered: enough
        for payload in payloads:
            try:
                batch = decode_batch(payload)
            except Exception:
                out.undecodable += 1
                continue
            out.newest_ts = max(out.newest_ts, batch.ts)
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    out.stored += 1
                    out.block_sizes.add(ev.block_size)
                    if ev.lora_id is not None or ev.lora_name:
                        out.adapters.add((ev.lora_id, ev.lora_name))
    except zmq.ZMQError as e:
        out.error = str(e)
    finally:
        ctx.destroy(linger=0)
    return out


def first_lines(items: Iterable[str], n: int = 8) -> str:
    """``a, b, c`` (and ``+N more``) for messages."""
    items = list(items)
    head = ", ".join(items[:n])
    return head + (f" +{len(items) - n} more" if len(items) > n else "")

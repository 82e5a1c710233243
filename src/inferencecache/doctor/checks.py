"""The verdicts of ``inferencecache doctor``: pure functions of what ``gather`` read.

Each check says PASS, FAIL or SKIP (its inputs were not given, or what it needs failed
already) with one line of detail that names the component and, on a failure, what to look at.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from inferencecache import __version__
from inferencecache.doctor.facts import first_lines
from inferencecache.doctor.gather import Facts

PASS: Final = "PASS"
FAIL: Final = "FAIL"
SKIP: Final = "SKIP"


@dataclass(frozen=True)
class Verdict:
    status: str
    check: str
    detail: str

    def line(self) -> str:
        return f"{self.status}  {self.check}: {self.detail}"


Check = Callable[[Facts], Iterator[Verdict]]


def run_checks(facts: Facts, now: float | None = None) -> list[Verdict]:
    """Every check, in the order an operator reads them."""
    now = time.time() if now is None else now
    out: list[Verdict] = []
    for check in CHECKS:
        out.extend(check(facts))
    out.extend(events_flowing(facts, now))
    out.extend(lora(facts))
    out.extend(gateways(facts))
    out.extend(probe(facts))
    return out


# ---- server -----------------------------------------------------------------------------------


def server_reachable(f: Facts) -> Iterator[Verdict]:
    sv = f.server
    problems = []
    if not sv.grpc_up:
        problems.append(f"{sv.grpc_error} (is serve running; is --server its --grpc-address?)")
    if not sv.http_up:
        assert sv.healthz is not None
        problems.append(f"{sv.healthz.problem()} (is --server-http its --http-address?)")
    if problems:
        yield Verdict(FAIL, "server reachable", "; ".join(problems))
    else:
        yield Verdict(PASS, "server reachable", f"gRPC {sv.address} and HTTP {sv.http} answer")


def server_healthy(f: Facts) -> Iterator[Verdict]:
    sv = f.server
    if not sv.grpc_up and not sv.http_up:
        yield Verdict(SKIP, "server healthy", "server unreachable")
        return
    problems = []
    if sv.grpc_up and sv.health != "SERVING":
        problems.append(f"grpc.health.v1 says {sv.health or 'nothing'} (shutting down?)")
    if sv.http_up:
        if sv.healthz is not None and not sv.healthz.ok:
            problems.append(f"/healthz {sv.healthz.problem()}")
        if sv.readyz is not None and not sv.readyz.ok:
            problems.append(f"/readyz {sv.readyz.problem()} (starting or shutting down)")
        up = sv.metrics.total("inferencecache_server_up") if sv.metrics else None
        if sv.metrics is None:
            assert sv.metrics_resp is not None
            problems.append(f"/metrics {sv.metrics_resp.problem()}")
        elif up != 1:
            problems.append(f"inferencecache_server_up is {up}")
    if problems:
        yield Verdict(FAIL, "server healthy", "; ".join(problems))
    else:
        yield Verdict(PASS, "server healthy", "gRPC health SERVING, /readyz ok, server_up 1")


LAG_LIMIT_S: Final = 10.0
"""A replica further behind the event log than this fails (the alert's threshold)."""


def event_log(f: Facts) -> Iterator[Verdict]:
    """Per replica (each ``worker`` of ``serve --workers``): lag behind the shared event log.
    No line at all for a server without ``--event-log`` (nothing to check, not a skipped
    input) or whose metrics could not be read (``server healthy`` fails then)."""
    m = f.server.metrics
    rows = m.samples.get("inferencecache_eventlog_replica_applied_sequence") if m else None
    if m is None or not rows:
        return
    parts, bad = [], []
    for labels, applied in sorted(rows, key=lambda r: r[0].get("worker", "")):
        worker = labels.get("worker")
        want = {"worker": worker} if worker is not None else {}
        entries = m.total("inferencecache_eventlog_replica_lag_entries", **want) or 0.0
        seconds = m.total("inferencecache_eventlog_replica_lag_seconds", **want) or 0.0
        ready = m.total("inferencecache_eventlog_replica_ready", **want)
        name = f"worker {worker}" if worker is not None else "replica"
        parts.append(f"{name} at {applied:.0f}, {entries:.0f} entries / {seconds:.1f}s behind")
        if seconds > LAG_LIMIT_S or ready != 1:
            bad.append(name)
    gaps = m.total("inferencecache_eventlog_gaps_total") or 0.0
    detail = "; ".join(parts) + (f"; {gaps:.0f} gaps since start" if gaps else "")
    if bad:
        yield Verdict(FAIL, "event log", f"not caught up: {', '.join(bad)} ({detail})")
    else:
        yield Verdict(PASS, "event log", detail)


# ---- agreement -------------------------------------------------------------------------------


def _server_info(f: Facts) -> dict[str, str]:
    m = f.server.metrics
    return (m.info("inferencecache_server_info") if m else None) or {}


def versions(f: Facts) -> Iterator[Verdict]:
    seen: dict[str, str] = {}
    if f.server.metrics is not None:
        seen["server"] = _server_info(f).get("version", "unknown (no inferencecache_server_info)")
    for sub in f.subscribers:
        if sub.metrics is not None:
            seen[f"subscriber {sub.name}"] = sub.info.get(
                "version", "unknown (no inferencecache_subscriber_info)"
            )
    for gw in f.gateways:
        if gw.metrics is not None:
            seen[f"gateway {gw.url}"] = gw.info.get(
                "version", "unknown (no inferencecache_gateway_info)"
            )
    if not seen:
        yield Verdict(SKIP, "versions", "no component's /metrics could be read")
        return
    distinct = sorted(set(seen.values()))
    if len(distinct) == 1:
        yield Verdict(PASS, "versions", f"{distinct[0]} on {_count(seen)} (doctor {__version__})")
    else:
        listed = first_lines(f"{who} {v}" for who, v in seen.items())
        yield Verdict(FAIL, "versions", f"components differ: {listed} (expected only mid-upgrade)")


_KINDS: Final = ("server", "subscriber", "gateway", "engine events", "engine")


def _count(seen: dict[str, str]) -> str:
    """``1 server, 2 subscribers, 1 KV-event stream`` for the sources in ``seen``."""
    kinds: dict[str, int] = {}
    for who in seen:
        kind = next((k for k in _KINDS if who.startswith(k + " ") or who == k), "other")
        kinds[kind] = kinds.get(kind, 0) + 1
    names = {"engine events": ("KV-event stream", "KV-event streams")}
    return ", ".join(
        f"{n} {names.get(k, (k, k + 's'))[n > 1]}" for k, n in kinds.items()
    )


def block_size(f: Facts) -> Iterator[Verdict]:
    seen: dict[str, str] = {}
    if "block_size" in _server_info(f):
        seen["server"] = _server_info(f)["block_size"]
    for sub in f.subscribers:
        if "block_size" in sub.info:
            seen[f"subscriber {sub.name}"] = sub.info["block_size"]
    for gw in f.gateways:
        if "block_size" in gw.info:
            seen[f"gateway {gw.url}"] = gw.info["block_size"]
    if f.engine is not None and f.engine.block_size is not None:
        seen[f"engine {f.engine.url}"] = str(f.engine.block_size)
    if f.events is not None and f.events.block_sizes:
        seen[f"engine events {f.events.endpoint}"] = ",".join(
            str(b) for b in sorted(f.events.block_sizes)
        )
    ignored = {
        sub.name: n
        for sub in f.subscribers
        if sub.metrics is not None
        and (n := sub.metrics.total("inferencecache_subscriber_events_ignored_total",
                                    reason="block_size") or 0) > 0
    }  # fmt: skip
    if len(set(seen.values())) > 1 or ignored:
        parts = [first_lines(f"{who} {v}" for who, v in seen.items())] if seen else []
        parts += [f"subscriber {who} ignored {n:g} events of another block size"
                  for who, n in ignored.items()]  # fmt: skip
        yield Verdict(FAIL, "block size", "; ".join(parts) + " (set one --block-size everywhere)")
    elif len(seen) > 1:
        yield Verdict(PASS, "block size", f"{next(iter(seen.values()))} on {_count(seen)}")
    elif seen:
        only = next(iter(seen.items()))
        yield Verdict(SKIP, "block size", f"only the {only[0]}'s is known ({only[1]})")
    else:
        yield Verdict(SKIP, "block size", "no component reports one")


def hash_scheme(f: Facts) -> Iterator[Verdict]:
    seen: dict[str, str] = {}
    for sub in f.subscribers:
        if "hash_scheme" in sub.info:
            seen[f"subscriber {sub.name}"] = sub.info["hash_scheme"]
    for gw in f.gateways:
        if "hash_scheme" in gw.info:
            seen[f"gateway {gw.url}"] = gw.info["hash_scheme"]
    if f.engine is not None and f.engine.family:
        seen[f"engine {f.engine.url}"] = f.engine.family
    if len(set(seen.values())) > 1:
        listed = first_lines(f"{who} {v}" for who, v in seen.items())
        yield Verdict(FAIL, "hash scheme", f"{listed} (set one --hash-scheme everywhere)")
    elif len(seen) > 1:
        yield Verdict(PASS, "hash scheme", f"{next(iter(seen.values()))} on {_count(seen)}")
    else:
        yield Verdict(SKIP, "hash scheme", "fewer than two components report one")


# ---- subscribers and the engine -------------------------------------------------------------


def subscribers(f: Facts) -> Iterator[Verdict]:
    for sub in f.subscribers:
        name = f"subscriber {sub.name}"
        if sub.metrics is None:
            yield Verdict(FAIL, name, sub.metrics_resp.problem())
            continue
        problems = []
        if sub.healthz is not None and not sub.healthz.ok:
            problems.append(f"/healthz {sub.healthz.problem()} (a task stopped)")
        if not sub.info:
            problems.append("no inferencecache_subscriber_info (not a subscriber?)")
        age = sub.metrics.total("inferencecache_subscriber_last_event_age_seconds")
        failures = sub.metrics.total("inferencecache_subscriber_rpc_failures_total") or 0
        if age is None or age < 0:
            problems.append(
                "no message from the engine since it started (idle engine, or "
                "--engine-endpoint is not the engine's KV-events endpoint)"
            )
        if problems:
            yield Verdict(FAIL, name, "; ".join(problems))
        else:
            yield Verdict(
                PASS, name,
                f"healthy, last engine message {age:.1f}s ago, {failures:g} failed RPCs so far",
            )  # fmt: skip


def engine(f: Facts) -> Iterator[Verdict]:
    e = f.engine
    if e is None:
        return
    if e.metrics is None:
        yield Verdict(FAIL, f"engine {e.url}", e.metrics_resp.problem())
        return
    adapters = e.adapters()
    detail = [e.family or "unknown engine family", f"block size {e.block_size or 'unknown'}"]
    if e.models is not None and not e.models.ok:
        detail.append(f"/v1/models {e.models.problem()}")
    else:
        detail.append(f"models {first_lines(e.served_models()) or 'none'}")
        detail.append(f"LoRA adapters {first_lines(adapters or []) or 'none'}")
    yield Verdict(PASS, f"engine {e.url}", ", ".join(detail))


def engine_events(f: Facts) -> Iterator[Verdict]:
    ev = f.events
    if ev is None:
        return
    name = f"engine events {ev.endpoint}"
    if ev.error:
        yield Verdict(FAIL, name, ev.error)
        return
    wait = f.settings.events_wait
    if ev.batches == 0:
        hint = "" if f.settings.replay_endpoint else " (give --replay-endpoint to read its buffer)"
        yield Verdict(
            FAIL, name,
            f"no KV-event batch within {wait:g}s: the engine is idle, or this is not its "
            f"kv-events endpoint{hint}",
        )  # fmt: skip
        return
    sizes = ",".join(str(b) for b in sorted(ev.block_sizes)) or "none stored"
    detail = (f"{ev.batches} batches ({ev.live} live, {ev.replayed} replayed), "
              f"{ev.stored} BlockStored, block size {sizes}")  # fmt: skip
    if ev.undecodable:
        yield Verdict(FAIL, name, f"{detail}; {ev.undecodable} undecodable (wire format?)")
    else:
        yield Verdict(PASS, name, detail)


CHECKS: Final[tuple[Check, ...]] = (
    server_reachable, server_healthy, event_log, versions, block_size, hash_scheme, subscribers,
    engine, engine_events,
)  # fmt: skip


# ---- the index -------------------------------------------------------------------------------

_TIME = re.compile(r"(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)(?:\.(\d+))?Z\Z")


def parse_go_time(text: str) -> float | None:
    """Seconds since the epoch of a Go RFC 3339 UTC time; None for the zero time or junk."""
    m = _TIME.match(text or "")
    if m is None or m.group(1) == "0001":
        return None
    y, mo, d, h, mi, s = (int(m.group(i)) for i in range(1, 7))
    frac = float("0." + m.group(7)) if m.group(7) else 0.0
    return datetime(y, mo, d, h, mi, s, tzinfo=UTC).timestamp() + frac


def _ago(ts: float | None, now: float) -> str:
    return "never" if ts is None else f"{max(0.0, now - ts):.1f}s ago"


def events_flowing(f: Facts, now: float) -> Iterator[Verdict]:
    sv = f.server
    name = "events flowing"
    if sv.snapshot is None:
        yield Verdict(SKIP, name, "server HTTP unreachable")
        return
    if not sv.snapshot.ok:
        hint = (" (pass --admin-token-file)" if sv.snapshot.status == 401 else "")
        if f.token_error:
            hint = f" ({f.token_error})"
        yield Verdict(FAIL, name, f"cannot read /snapshot: {sv.snapshot.problem()}{hint}")
        return
    doc = sv.snapshot.json()
    rows: list[dict[str, Any]] = doc.get("replicas", []) if isinstance(doc, dict) else []
    known = {str(r.get("replicaId")) for r in rows}
    for sub in f.subscribers:
        rid = sub.info.get("replica_id")
        if rid and rid not in known:
            yield Verdict(
                FAIL, f"{name} {rid}",
                f"subscriber {sub.url} runs, but the index has no row for it: its reports do "
                "not arrive (its --server, or no event yet)",
            )  # fmt: skip
    if not rows:
        yield Verdict(FAIL, name, "the index has no replica: no subscriber has reported")
        return
    limit = f.settings.max_event_age
    for r in rows:
        rid, tenant = str(r.get("replicaId")), str(r.get("tenant", ""))
        event, stats = parse_go_time(str(r.get("lastEventAt"))), parse_go_time(
            str(r.get("lastUpdate"))
        )
        newest = max((t for t in (event, stats) if t is not None), default=None)
        detail = (f"tenant {tenant or '(none)'}: {r.get('prefixCount', 0)} holds, newest event "
                  f"{_ago(event, now)}, stats {_ago(stats, now)}")  # fmt: skip
        if newest is None or now - newest > limit:
            yield Verdict(FAIL, f"{name} {rid}", f"{detail}: silent for over {limit:g}s")
        else:
            yield Verdict(PASS, f"{name} {rid}", detail)


def lora(f: Facts) -> Iterator[Verdict]:
    """The engine's adapter names (``/v1/models``, events) against each subscriber's table."""
    name = "LoRA adapters"
    served = f.engine.adapters() if f.engine is not None else None
    tables = {sub.name: sub.info for sub in f.subscribers if sub.info}
    if served is None and not tables:
        yield Verdict(SKIP, name, "no engine /v1/models and no subscriber to compare")
        return
    problems = []
    for who, info in tables.items():
        pairs = dict(
            item.split("=", 1) for item in info.get("lora_adapter_names", "").split(",") if item
        )
        trust = info.get("trust_lora_name", "true") == "true"
        if served is not None:
            stray = sorted(set(pairs.values()) - set(served))
            if stray:
                serves = first_lines(served) or "none"
                problems.append(f"subscriber {who} maps ids to {first_lines(stray)}, which the "
                                f"engine does not serve (it serves {serves})")
            if served and not trust and not set(served) <= set(pairs.values()):
                missing = sorted(set(served) - set(pairs.values()))
                problems.append(f"subscriber {who} has --trust-lora-name=false and no id for "
                                f"{first_lines(missing)}: their blocks are dropped")
        if f.events is not None:
            for lora_id, lora_name in sorted(f.events.adapters, key=str):
                mapped = pairs.get(str(lora_id)) if lora_id is not None else None
                if mapped is not None and lora_name and mapped != lora_name:
                    problems.append(f"engine events name adapter id {lora_id} {lora_name!r}, "
                                    f"subscriber {who} maps it to {mapped!r}")
                elif mapped is None and not (lora_name and trust):
                    problems.append(f"engine events carry adapter id {lora_id} that subscriber "
                                    f"{who} cannot name (add it to --lora-adapter-names)")
        sub = next(s for s in f.subscribers if s.name == who)
        m = sub.metrics
        drops = m.total("inferencecache_subscriber_lora_drops_total") if m is not None else 0
        if drops:
            problems.append(f"subscriber {who} dropped {drops:g} stores of unnamed adapters")
    if problems:
        yield Verdict(FAIL, name, "; ".join(dict.fromkeys(problems)))
    else:
        shown = first_lines(served) if served else "none served"
        yield Verdict(PASS, name, f"{shown}; every subscriber names them as the engine does")


def gateways(f: Facts) -> Iterator[Verdict]:
    doc = f.server.snapshot.json() if f.server.snapshot is not None else None
    rows = doc.get("replicas", []) if isinstance(doc, dict) else []
    indexed = {str(r.get("replicaId")) for r in rows} if f.server.snapshot is not None and (
        f.server.snapshot.ok) else None
    for gw in f.gateways:
        name = f"gateway {gw.url}"
        if gw.metrics is None:
            yield Verdict(FAIL, name, gw.metrics_resp.problem())
            continue
        health = gw.healthz.json() if gw.healthz is not None else None
        engines = health.get("engines", {}) if isinstance(health, dict) else {}
        if not isinstance(engines, dict) or not engines:
            yield Verdict(FAIL, name, "no engine list in /healthz")
            continue
        down = sorted(rid for rid, e in engines.items()
                      if not (isinstance(e, dict) and e.get("healthy")))  # fmt: skip
        problems = []
        if down:
            problems.append(f"engines down: {first_lines(down)}")
        if indexed is not None:
            unknown = sorted(set(engines) - indexed)
            if unknown:
                problems.append(
                    f"engines {first_lines(unknown)} are not replicas in the index (their "
                    "subscribers' --replica-id must equal the gateway's --engines ids)"
                )
        if problems:
            yield Verdict(FAIL, name, "; ".join(problems))
        else:
            yield Verdict(PASS, name, f"engines {first_lines(sorted(engines))} healthy and indexed"
                          if indexed is not None else
                          f"engines {first_lines(sorted(engines))} healthy")  # fmt: skip


def probe(f: Facts) -> Iterator[Verdict]:
    sv = f.server
    name = "probe tenant"
    if sv.probe is None and not sv.grpc_up:
        yield Verdict(SKIP, name, "server unreachable")
        return
    problems, done = [], []
    if sv.probe is not None:
        doc = sv.probe.json() if sv.probe.ok else None
        if not isinstance(doc, dict):
            hint = " (pass --admin-token-file)" if sv.probe.status == 401 else ""
            problems.append(f"/probe {sv.probe.problem()}{hint}")
        elif doc.get("ingest") != "ok" or doc.get("routing") != "ok":
            problems.append(f"/probe ingest {doc.get('ingest')}, routing {doc.get('routing')}: "
                            f"{doc.get('errors', '')}")
        else:
            done.append("/probe ingest and routing ok")
    if sv.grpc_up:
        if sv.probe_ack != "accepted":
            problems.append(f"ReportCacheState {sv.probe_ack}")
        elif sv.probe_lookup != "NO_HINT":
            problems.append(f"LookupRoute answered {sv.probe_lookup} (want NO_HINT)")
        else:
            done.append("gRPC report acked, lookup NO_HINT")
    if problems:
        yield Verdict(FAIL, name, "; ".join(problems))
    else:
        yield Verdict(PASS, name, f"model {f.probe_model}, scheme {f.probe_scheme}: "
                      + ", ".join(done))  # fmt: skip

"""The pure parts of doctor: Go time parsing, Prometheus text reading, verdict formatting."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from inferencecache.doctor.checks import PASS, Verdict, parse_go_time
from inferencecache.doctor.facts import Metrics, Response, first_lines
from inferencecache.doctor.settings import DoctorSettings, split_urls

PAGE = """# HELP inferencecache_subscriber_info x
# TYPE inferencecache_subscriber_info gauge
inferencecache_subscriber_info{block_size="16",replica_id="r0",version="0.1.0"} 1.0
# HELP inferencecache_subscriber_events_ignored_total x
# TYPE inferencecache_subscriber_events_ignored_total counter
inferencecache_subscriber_events_ignored_total{reason="block_size"} 3.0
inferencecache_subscriber_events_ignored_total{reason="group"} 4.0
# HELP vllm:cache_config_info x
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",engine="0"} 1.0
"""


def test_go_times_parse_with_nanoseconds_and_the_zero_time_is_never() -> None:
    want = datetime(2026, 12, 1, 22, 14, 35, tzinfo=UTC).timestamp()
    assert parse_go_time("2026-12-01T22:14:35Z") == want
    got = parse_go_time("2026-12-01T22:14:35.123456789Z")
    assert got is not None and abs(got - (want + 0.123456789)) < 1e-6
    assert parse_go_time("0001-01-01T00:00:00Z") is None
    assert parse_go_time("yesterday") is None


def test_metrics_are_read_by_name_and_labels() -> None:
    m = Metrics.parse(PAGE)
    assert m.total("inferencecache_subscriber_events_ignored_total") == 7
    assert m.total("inferencecache_subscriber_events_ignored_total", reason="block_size") == 3
    assert m.total("inferencecache_subscriber_missing_total") is None
    assert m.info("inferencecache_subscriber_info") == {
        "block_size": "16", "replica_id": "r0", "version": "0.1.0"}
    assert m.prefixed("vllm:") and not m.prefixed("sglang:")


def test_response_problems_name_the_url_and_status() -> None:
    assert Response("http://x/readyz", 503, b"not ready\n").problem() == (
        "http://x/readyz: HTTP 503 (not ready)")
    assert Response("http://x/", error="[Errno 111] Connection refused").problem() == (
        "http://x/: [Errno 111] Connection refused")


def test_lists_are_cut_after_eight_items() -> None:
    assert first_lines([str(i) for i in range(10)]) == "0, 1, 2, 3, 4, 5, 6, 7 +2 more"
    assert Verdict(PASS, "versions", "0.1.0").line() == "PASS  versions: 0.1.0"


def test_settings_split_and_check_urls() -> None:
    assert split_urls("--subscribers", " http://a:1/ ,, https://b:2") == (
        "http://a:1", "https://b:2")
    with pytest.raises(ValueError, match="--gateways"):
        DoctorSettings(gateways="http://a:1?x=1")
    assert DoctorSettings(admin_url="http://admin:8081/").admin_base == "http://admin:8081"
    assert DoctorSettings().admin_base == "http://127.0.0.1:8080"


def test_event_log_lag_per_worker() -> None:
    """doctor's "event log" line: each worker's position and lag; one behind fails it."""
    from types import SimpleNamespace

    from inferencecache.doctor.checks import FAIL, event_log

    page = """# TYPE inferencecache_eventlog_replica_applied_sequence gauge
inferencecache_eventlog_replica_applied_sequence{worker="0"} 120.0
inferencecache_eventlog_replica_applied_sequence{worker="1"} 90.0
# TYPE inferencecache_eventlog_replica_lag_entries gauge
inferencecache_eventlog_replica_lag_entries{worker="0"} 0.0
inferencecache_eventlog_replica_lag_entries{worker="1"} 30.0
# TYPE inferencecache_eventlog_replica_lag_seconds gauge
inferencecache_eventlog_replica_lag_seconds{worker="0"} 0.0
inferencecache_eventlog_replica_lag_seconds{worker="1"} 42.5
# TYPE inferencecache_eventlog_replica_ready gauge
inferencecache_eventlog_replica_ready{worker="0"} 1.0
inferencecache_eventlog_replica_ready{worker="1"} 1.0
"""
    facts: Any = SimpleNamespace(server=SimpleNamespace(metrics=Metrics.parse(page)))
    (v,) = event_log(facts)
    assert v.status == FAIL and "worker 1" in v.detail and "worker 0" in v.detail
    assert "42.5s" in v.detail
    caught_up = page.replace("42.5", "0.5")
    facts.server.metrics = Metrics.parse(caught_up)
    (v,) = event_log(facts)
    assert v.status == PASS
    facts.server.metrics = Metrics.parse("# TYPE inferencecache_server_up gauge\n"
                                         "inferencecache_server_up 1.0\n")
    assert list(event_log(facts)) == []  # no line without --event-log

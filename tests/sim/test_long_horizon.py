"""Long simulated runs (issue 11): --duration, the per-window time series, the refresher and the
adapter tracker running in simulated time, and the lora-churn workload."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest

from inferencecache.engines.simulated import EngineParams
from inferencecache.procs import run_cli
from inferencecache.sim import cluster, report
from inferencecache.sim.simulator import SimConfig, simulate
from inferencecache.sim.workloads import (
    LORA,
    ChurnShape,
    WorkloadSpec,
    adapter_schedule,
    generate,
)

BIG = EngineParams(block_size=16, num_blocks=20_000, max_num_seqs=8)
FAST_CHURN = ChurnShape(on_s=(20.0, 40.0), off_s=(5.0, 15.0))


def cfg(policy: str, workload: WorkloadSpec, **kw: object) -> SimConfig:
    params = cluster.default_policy_params(BIG).get(policy, {})
    base = SimConfig(workload=workload, policy=policy,
                     policy_params=tuple(sorted(params.items())), replicas=4, engine=BIG,
                     max_concurrency_ceiling=BIG.max_num_seqs)
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def test_duration_generates_every_arrival_before_it() -> None:
    rs = list(generate(WorkloadSpec("chat", 5, 2.0, 1, duration=600.0)))
    assert 900 < len(rs) < 1500  # ~2/s for 600 s, --requests ignored
    assert rs[-1].arrival < 600.0 and rs[-1].arrival > 590.0
    assert [r.index for r in rs] == list(range(len(rs)))
    with pytest.raises(ValueError, match="duration"):
        WorkloadSpec("chat", duration=-1.0)


def test_windows_add_up_to_the_run_and_land_in_the_document() -> None:
    wl = WorkloadSpec("chat", 0, 4.0, 2, duration=300.0)
    r = simulate(cfg("cache_aware", wl, series_window_s=60.0))
    assert [w.start_s for w in r.windows] == [0.0, 60.0, 120.0, 180.0, 240.0]
    assert sum(w.requests for w in r.windows) == r.requests == len(r.ttft_s)
    assert sum(w.hit_tokens for w in r.windows) == r.hit_tokens
    assert sum(w.query_tokens for w in r.windows) == r.query_tokens
    rows = r.series()
    assert [row["span_s"] for row in rows] == [60.0] * 5
    doc = report.document("chat", {"cache_aware": r.summary()}, {"cache_aware": rows}, 60.0)
    assert report.is_document(doc)
    assert json.loads(json.dumps(doc)) == doc
    bad = json.loads(json.dumps(doc))
    bad["series"]["policies"]["cache_aware"][0]["requests"] = 1.5
    assert not report.is_document(bad)


def test_series_targets_judge_every_full_window_after_the_first() -> None:
    def doc(ca: list[float], orc: list[float], ttft: list[float]) -> dict[str, object]:
        def rows(hits: list[float], t: list[float]) -> list[dict[str, float | int]]:
            return [report.series_row(i * 600.0, 600.0, h, [x / 1000], 10)
                    for i, (h, x) in enumerate(zip(hits, t, strict=True))]
        pols = {"cache_aware": {"hit_rate": 0.5, "ttft_p50_ms": 1.0, "ttft_p90_ms": 1.0,
                                "requests": 1, "hint_overhead_p50_ms": 0.0}}
        return report.document("chat", pols, {"cache_aware": rows(ca, ttft),
                                              "oracle": rows(orc, ttft)}, 600.0)

    ok = dict((n, m) for n, m, _ in report.series_targets(
        doc([0.5, 0.72, 0.71], [0.73, 0.73, 0.73], [26, 27, 28])))
    assert list(ok.values()) == [True, True]
    bad = [m for _, m, _ in report.series_targets(
        doc([0.9, 0.72, 0.6], [0.73, 0.73, 0.73], [26, 27, 44]))]
    assert bad == [False, False]  # 82% of the oracle at 20 min; TTFT 1.7x its first window


def test_refresh_keeps_a_quiet_prefix_matchable_past_the_ttl() -> None:
    """A 60 s TTL over a 10-minute chat run with room for everything: without the refresher the
    index forgets system prompts the engines still hold (cache_aware falls behind the oracle);
    with it (a 20 s cycle, the same code as the subscriber's) it keeps up."""
    wl = WorkloadSpec("chat", 0, 2.0, 5, duration=600.0)
    oracle = simulate(cfg("oracle", wl, ttl_s=60.0))
    on = simulate(cfg("cache_aware", wl, ttl_s=60.0, refresh_interval_s=20.0))
    off = simulate(cfg("cache_aware", wl, ttl_s=60.0, refresh_interval_s=0.0))
    assert on.refreshed_entries > 0 and off.refreshed_entries == 0
    assert on.hit_rate >= 0.97 * oracle.hit_rate
    assert off.hit_rate < on.hit_rate - 0.02
    assert on.stale_hints == 0  # re-reporting resident blocks never makes a hint wrong


def test_churn_schedule_is_seeded_and_sessions_end_with_their_adapter() -> None:
    spec = WorkloadSpec("lora-churn", 0, 8.0, 3, duration=600.0, churn=FAST_CHURN)
    a, b = adapter_schedule(spec), adapter_schedule(spec)
    times = [t * 7.3 for t in range(80)]
    assert [a.served(t) for t in times] == [b.served(t) for t in reversed(times)][::-1]
    name = LORA.adapters[0]
    versions = [a.version(name, t) for t in range(600)]
    loaded = [v for v in versions if v is not None]
    assert None in versions and max(loaded) >= 5  # unloaded at times, reloaded many times
    assert all(x <= y for x, y in itertools.pairwise(loaded))  # versions only grow
    served = a.served(100.0)
    for n, root in served.items():
        assert root.endswith(f"/v{a.version(n, 100.0)}")
    rs = list(generate(spec))
    assert {r.kind for r in rs} == {"lora"}
    for r in rs:  # every request goes to the version loaded when it arrives
        assert r.adapter_version == a.version(r.adapter, r.arrival)
        assert r.engine_adapter == f"{r.adapter}@v{r.adapter_version}"
    assert len({(r.adapter, r.adapter_version) for r in rs}) > 30


def test_tracking_adapter_lifecycle_leaves_no_stale_hints() -> None:
    """Adapters unloaded and reloaded with new weights: without tracking, the index keeps
    pointing at blocks of the old versions (hints that name tokens the replica no longer has
    for this adapter); with the tracker (the subscriber's code, fed what the engines serve) the
    partition is dropped at every unload."""
    wl = WorkloadSpec("lora-churn", 0, 4.0, 4, duration=400.0, churn=FAST_CHURN)
    on = simulate(cfg("cache_aware", wl, adapter_poll_s=2.0))
    off = simulate(cfg("cache_aware", wl, adapter_poll_s=0.0))
    assert on.adapters_forgotten > 20 and off.adapters_forgotten == 0
    assert off.stale_hints > 10
    assert on.stale_hints < off.stale_hints / 5
    assert sum(w.stale_hints for w in off.windows) == off.stale_hints


def test_simulate_duration_writes_the_series_and_its_plot(tmp_path: Path) -> None:
    out = tmp_path / "sim"
    r = run_cli(["simulate", "--workload", "chat", "--duration", "3m", "--series-window", "1m",
                 "--policies", "cache_aware,oracle", "--replicas", "2", "--request-rate", "2",
                 "--out", str(out)], timeout=120)
    assert r.returncode == 0, r.stderr
    doc = json.loads((out / "simulate-chat.json").read_text())
    assert report.is_document(doc)
    assert doc["series"]["window_s"] == 60.0
    for rows in doc["series"]["policies"].values():
        assert [row["start_s"] for row in rows] == [0.0, 60.0, 120.0]
    png = (out / "simulate.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000
    assert "3m at 2/s" in r.stdout
    bad = run_cli(["simulate", "--duration", "-1s"], timeout=30)
    assert bad.returncode == 2 and "--duration" in bad.stderr


def test_a_run_by_request_count_ends_with_a_partial_window_left_out_of_the_targets() -> None:
    r = simulate(cfg("cache_aware", WorkloadSpec("chat", 300, 4.0, 2), series_window_s=30.0))
    rows = r.series()
    assert [row["span_s"] for row in rows[:-1]] == [30.0] * (len(rows) - 1)
    assert 0 < float(rows[-1]["span_s"]) < 30.0  # up to the last arrival
    assert r.workload_seconds == pytest.approx(
        float(rows[-1]["start_s"]) + float(rows[-1]["span_s"]), abs=0.001)  # rounded to ms
    full = report.full_windows(rows, 30.0)
    assert len(full) == len(rows) - (float(rows[-1]["span_s"]) < report.SERIES_MIN_SPAN * 30)
    assert report.full_windows([{**rows[0], "span_s": 10.0}], 30.0) == []

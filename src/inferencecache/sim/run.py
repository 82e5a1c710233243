"""``inferencecache simulate``: every (sweep point, workload, policy) through the simulator."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from inferencecache.config import format_duration
from inferencecache.sim import cluster, report
from inferencecache.sim.settings import SimulateSettings, parse_sweep, with_value
from inferencecache.sim.simulator import SimConfig, simulate
from inferencecache.sim.workloads import WORKLOADS, WorkloadSpec


def config(s: SimulateSettings, workload: str, policy: str) -> SimConfig:
    """The simulator configuration of one run of ``simulate``'s flags."""
    engine = s.engine
    params = cluster.merged_params(engine, cluster.parse_policy_params(s.policy_params))
    return SimConfig(
        workload=WorkloadSpec(workload, s.requests, s.request_rate, s.seed, cluster.MODEL,
                              duration=s.duration),
        policy=policy,
        policy_params=tuple(sorted(params.get(policy, {}).items())),
        replicas=s.replicas,
        engine=engine,
        tenant_id=cluster.TENANT,
        stats_interval_s=cluster.STATS_INTERVAL_S,
        max_concurrency_ceiling=cluster.max_concurrency_ceiling(engine),
        gateways=s.gateways,
        refresh_interval_s=s.refresh_interval,
        adapter_poll_s=s.adapter_poll_interval,
        series_window_s=s.series_window,
        ttl_s=s.default_ttl,
    )


def expected_requests(s: SimulateSettings) -> int:
    """The progress bar's total: --requests, or what --duration at --request-rate gives."""
    return round(s.duration * s.request_rate) if s.duration > 0 else s.requests


def _span(s: SimulateSettings) -> str:
    if s.duration > 0:
        return f"{format_duration(s.duration)} at {s.request_rate:g}/s"
    return f"{s.requests} requests at {s.request_rate:g}/s"


def run_simulate(s: SimulateSettings, console: Console | None = None) -> int:
    console = console or Console()
    started = time.monotonic()
    workloads = list(WORKLOADS) if s.workload == "all" else [s.workload]
    policies = cluster.parse_policies(s.policies)
    points: list[tuple[str, int | float | None]] = [("", None)]
    if s.sweep:
        name, values = parse_sweep(s.sweep)
        points = [(name, v) for v in values]
    runs: list[tuple[str, int | float | None, dict[str, Any]]] = []
    progress = Progress(
        TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), TextColumn("{task.fields[note]}"), console=console,
    )
    with progress:
        for name, value in points:
            ss = with_value(s, name, value) if value is not None else s
            tag = f" {name}={value:g}" if value is not None else ""
            for wl in workloads:
                results: dict[str, dict[str, float | int]] = {}
                series: dict[str, list[dict[str, float | int]]] = {}
                for policy in policies:
                    task = progress.add_task(f"{wl} {policy}{tag}", total=expected_requests(ss),
                                             note="")

                    def tick(n: int, t: Any = task) -> None:
                        progress.update(t, completed=n)

                    r = simulate(config(ss, wl, policy), progress=tick)
                    results[policy] = r.summary()
                    series[policy] = r.series()
                    progress.update(
                        task,
                        note=f"hit {r.hit_rate:.1%}  p90 {results[policy]['ttft_p90_ms']:.0f} ms"
                        f"  ({r.wall_seconds:.1f}s)",
                    )
                runs.append((name, value, report.document(wl, results, series,
                                                          ss.series_window)))
    out = Path(s.out) if s.out else None
    docs = [doc for _, _, doc in runs]
    for name, value, doc in runs:
        where = f", {name}={value:g}" if value is not None else ""
        title = (f"simulate: {doc['workload']}, {s.replicas if name != 'replicas' else value} "
                 f"engines, {_span(s)}{where}")
        console.print(report.table(doc, title))
        if out is not None:
            suffix = f"-{name}{value:g}" if value is not None else ""
            report.write_json(out / f"simulate-{doc['workload']}{suffix}.json", doc)
    console.print(report.targets_table(docs))
    if out is not None:
        title = f"simulate: {s.replicas} engines, {_span(s)}"
        if not s.sweep:
            png = report.plot(docs, out / "simulate.png", title)
            console.print(f"wrote {out}/simulate-*.json and {png}")
        else:
            console.print(f"wrote {out}/simulate-*.json")
    console.print(f"done in {time.monotonic() - started:.0f}s")
    return 0

"""Every benchmark in one run: a table on stdout and the figures as JSON.

    python bench/run.py [--quick | --smoke] [--json FILE] [--no-peer] [--only S,...] [--skip S,...]

Sections (each is another script's ``run(quick)``; nothing is measured twice):
- ``vs_dynamo``   bench/vs_dynamo.py: our index vs Dynamo's RadixTree in process (same workload)
- ``service``     bench/vs_dynamo_service.py: subscribe+serve vs Dynamo's indexer service
- ``fingerprint`` bench/fingerprint.py: 8192 tokens → 512-hash chain
- ``index``       bench/index.py: bytes per hold, store walk
- ``grpc_lookup`` bench/grpc_lookup.py: LookupRoute over gRPC on loopback, the server stacks
- ``gateway``     bench/gateway.py: what the reference gateway adds, its hint round trip
- ``e2e_ingest``  bench/e2e_ingest.py: fake engine → subscriber → server, blocks/s
- ``refresh``     bench/refresh.py: CPU of keeping live holds alive (subscriber and server)
- ``log``         bench/eventlog.py: the shared event log (ingest through it, lag, start-up,
                  ``--workers``), each against a baseline of the same run

``--quick`` fits in 10 minutes on 2 cores. ``--smoke`` (CI) is tiny and checks correctness only
(both sides' answers against the oracle), never timing; the other sections are only imported.
Dynamo is installed on first use into ``bench/.venv-peers`` (``ai-dynamo-runtime`` pinned, never
into the project's venv). If that install fails (PyPI unreachable), ``--smoke`` goes on with our
side only and says so loudly; the other modes fail. The JSON goes to ``--json FILE`` (``-`` =
stdout) and always to ``bench/results/run-<mode>-<time>.json`` (git-ignored). Exit status 1 when
a section failed or an answer was wrong; missed targets do not change it.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `bench` importable
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import importlib
import json
import os
import platform
import time
import traceback
from collections.abc import Callable
from typing import Any

from bench import common

SECTIONS = ("vs_dynamo", "service", "fingerprint", "index", "grpc_lookup", "gateway",
            "e2e_ingest", "refresh", "log")
MODULES = {
    "vs_dynamo": "bench.vs_dynamo",
    "service": "bench.vs_dynamo_service",
    "fingerprint": "bench.fingerprint",
    "index": "bench.index",
    "grpc_lookup": "bench.grpc_lookup",
    "gateway": "bench.gateway",
    "e2e_ingest": "bench.e2e_ingest",
    "refresh": "bench.refresh",
    "log": "bench.eventlog",
}

# key -> (comparison, target, unit, what it is)
TARGETS: dict[str, tuple[str, float, str, str]] = {
    "lookup_speedup_vs_dynamo": (">=", 3.0, "×", "in process: lookups/s, ours ÷ Dynamo RadixTree"),
    "ingest_speedup_vs_dynamo": (">=", 5.0, "×", "in process: events/s, ours ÷ Dynamo RadixTree"),
    "inproc_ingest_ratio_vs_dynamo_fast": (">=", 3.0, "×",
                                           "in process: blocks/s ÷ Dynamo, fast mode"),
    "inproc_lookup_ratio_vs_dynamo_fast": (">=", 3.0, "×",
                                           "in process: lookups/s ÷ Dynamo, fast mode"),
    "http_lookup_p50_ratio_vs_dynamo": ("<=", 1.0, "×",
                                        "services: lookup p50, our HTTP ÷ dynamo.indexer HTTP"),
    "http_lookups_per_s_ratio_vs_dynamo": (">=", 1.0, "×",
                                           "services: lookups/s, 32 callers, HTTP"),
    "grpc_lookup_chain_over_floor": ("<=", 1.15, "×",
                                     "LookupRoute chain p50 ÷ trivial RPC p50, same server"),
    "demo_hint_overhead_p50_ms": ("<", 0.5, "ms", "gateway's hint round trip p50 (network path)"),
    "service_ingest_speedup_vs_dynamo": (">=", 2.0, "×",
                                         "services: blocks/s, subscribe+serve ÷ dynamo.indexer"),
    "service_lookup_p50_ratio_vs_dynamo": ("<=", 1.0, "×",
                                           "services: lookup p50, our gRPC ÷ their HTTP"),
    "grpc_lookup_chain_p50_us": ("<=", 300.0, "µs", "LookupRoute, 512-block chain, c=1, p50"),
    "grpc_lookup_chain_p99_us": ("<=", 1000.0, "µs", "LookupRoute, 512-block chain, c=1, p99"),
    "grpc_lookup_tokens_p50_us": ("<=", 500.0, "µs", "LookupRoute, 8192 token_ids, c=1, p50"),
    "grpc_lookup_tokens_p99_us": ("<=", 1500.0, "µs", "LookupRoute, 8192 token_ids, c=1, p99"),
    "grpc_floor_p50_us": ("", 0.0, "µs", "trivial unary RPC p50 on the serve stack (context)"),
    "e2e_ingest_blocks_per_s": (">=", 100_000.0, "/s", "engine → subscriber → server"),
    "bytes_per_hold_10m": ("<=", 120.0, "B", "RSS per hold at 10M holds"),
    "fingerprint_us_8k": ("<=", 20.0, "µs", "8192 tokens → 512-hash chain"),
    "refresh_server_cpu_pct_100_engines": ("<=", 2.0, "%",
                                           "refresh of 100 engines × 20k blocks, server core"),
    "log_ingest_ratio_1": (">=", 0.5, "×", "blocks/s through the event log ÷ direct e2e ingest"),
    "log_lag_p99_ms": ("<=", 50.0, "ms", "event log append → visible on a replica, p99"),
    "log_startup_snapshot_s": ("<=", 3.0, "s", "replica ready from a snapshot of 1M holds"),
    "log_lookup_workers_ratio": (">=", 1.4, "×",
                                 "LookupRoute req/s, 32 callers, --workers 2 ÷ 1"),
}
REQUIRED_KEYS = tuple(TARGETS)

# Context rows printed under the targets: (key, label)
DETAILS: tuple[tuple[str, str], ...] = (
    ("inproc_ours_lookup_p50_us", "in process: our Router.lookup p50 µs"),
    ("inproc_ours_lookup_p99_us", "in process: our Router.lookup p99 µs"),
    ("inproc_ours_walk_p50_us", "in process: our store walk alone p50 µs"),
    ("inproc_dynamo_fast_lookup_p50_us", "in process: Dynamo find_matches p50 µs, fast mode"),
    ("inproc_dynamo_slow_lookup_p50_us", "in process: Dynamo find_matches p50 µs, slow mode"),
    ("inproc_ours_lookups_per_s", "in process: our lookups/s"),
    ("inproc_dynamo_fast_lookups_per_s", "in process: Dynamo lookups/s, fast mode"),
    ("inproc_dynamo_slow_lookups_per_s", "in process: Dynamo lookups/s, slow mode"),
    ("inproc_lookup_ratio_vs_dynamo_slow", "in process: lookups/s ÷ Dynamo, slow mode"),
    ("lookup_raw_speedup_vs_dynamo", "in process: our walk alone ÷ Dynamo, lookups/s"),
    ("inproc_ours_ingest_events_per_s", "in process: our ingest events/s"),
    ("inproc_ours_chain_ingest_events_per_s", "in process: our ingest events/s, chain entries"),
    ("inproc_ours_legacy_ingest_events_per_s",
     "in process: our ingest events/s, legacy objects, 1 event/evicted block"),
    ("inproc_ours_ingest_blocks_per_s", "in process: our ingest blocks/s"),
    ("inproc_dynamo_fast_ingest_blocks_per_s", "in process: Dynamo ingest blocks/s, fast mode"),
    ("inproc_dynamo_slow_ingest_blocks_per_s", "in process: Dynamo ingest blocks/s, slow mode"),
    ("inproc_ingest_ratio_vs_dynamo_slow", "in process: blocks/s ÷ Dynamo, slow mode"),
    ("service_ours_ingest_blocks_per_s", "services: our ingest blocks/s"),
    ("service_dynamo_ingest_blocks_per_s", "services: Dynamo ingest blocks/s"),
    ("service_engine_feed_blocks_per_s", "services: fake engine feed blocks/s (ceiling)"),
    ("service_ingest_speedup_vs_dynamo_evicting", "services: ingest ratio with evictions"),
    ("service_ours_ingest_blocks_per_s_evicting", "services: our ingest blocks/s, evicting"),
    ("service_dynamo_ingest_blocks_per_s_evicting", "services: Dynamo ingest blocks/s, evicting"),
    ("service_ours_floor_p50_us", "services: trivial gRPC unary p50 µs (our floor)"),
    ("service_dynamo_floor_p50_us", "services: empty HTTP query p50 µs (their floor)"),
    ("service_ours_lookup_chain_p50_us", "services: our LookupRoute (chain) p50 µs"),
    ("service_dynamo_lookup_chain_p50_us", "services: Dynamo /query_by_hash p50 µs"),
    ("service_ours_lookup_http_chain_p50_us", "services: our HTTP /v1/lookup (chain) p50 µs"),
    ("service_dynamo_lookup_http_chain_p50_us", "services: Dynamo /query_by_hash p50 µs (HTTP)"),
    ("http_lookup_tokens_p50_ratio_vs_dynamo", "services: /query (tokens) p50, ours ÷ theirs"),
    ("service_ours_http_lookups_per_s_c32", "services: our HTTP lookups/s, 32 callers"),
    ("service_dynamo_http_lookups_per_s_c32", "services: Dynamo HTTP lookups/s, 32 callers"),
    ("service_lookup_tokens_p50_ratio_vs_dynamo", "services: token-id lookup p50 ratio"),
    ("grpc_lookup_holds", "gRPC lookup: holds loaded"),
    ("grpc_lookup_baseline_p50_us", "gRPC lookup: trivial unary RPC p50 µs (floor)"),
    ("grpc_lookup_chain_p50_us_c8", "gRPC lookup: chain p50 µs at concurrency 8"),
    ("grpc_lookup_sized_floor_p50_us", "gRPC lookup: no-op RPC with a chain-sized request, p50"),
    ("grpc_lookup_chain_over_sized_floor", "gRPC lookup: chain p50 ÷ that same-size no-op"),
    ("grpc_stack_sync_p50_us", "gRPC stack: sync server, trivial RPC p50 µs (c=1)"),
    ("grpc_stack_aio_uvloop_p50_us", "gRPC stack: grpc.aio on uvloop, trivial RPC p50 µs"),
    ("grpc_stack_sync_per_s_c32", "gRPC stack: sync server, RPCs/s at 32 callers"),
    ("grpc_stack_aio_uvloop_per_s_c32", "gRPC stack: grpc.aio on uvloop, RPCs/s at 32 callers"),
    ("gateway_hint_grpc_p50_ms", "gateway: hint round trip p50 ms over gRPC"),
    ("gateway_hint_http_p50_ms", "gateway: hint round trip p50 ms over HTTP"),
    ("gateway_added_p50_ms", "gateway: latency it adds to a request, p50 ms"),
    ("bytes_per_hold_1m", "bytes per hold at 1M holds"),
    ("fingerprint_floor_bulk_us", "fingerprint floor: one XXH3 call over 32 KiB, µs"),
    ("refresh_entries_per_s_per_engine", "refresh: entries/s per engine (20k blocks, 10 min)"),
    ("refresh_sub_cpu_pct_per_engine", "refresh: subscriber CPU % of a core per engine"),
    ("refresh_server_cpu_us_per_entry", "refresh: server CPU µs per re-reported entry"),
    ("refresh_server_cpu_pct_100_engines_direct",
     "refresh: server CPU % with 100 engines' traffic, measured"),
)


def machine() -> dict[str, Any]:
    """What the figures were measured on (they swing with load: note it)."""
    model = ""
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem_gib = 0.0
    with open("/proc/meminfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_gib = int(line.split()[1]) / 1024 / 1024
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_gib, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg_start": list(os.getloadavg()),
    }


def _met(key: str, value: Any) -> bool | None:
    if key not in TARGETS or not isinstance(value, int | float):
        return None
    op, target, _unit, _what = TARGETS[key]
    if op == ">=":
        return value >= target
    if op == "<=":
        return value <= target
    if op == "<":
        return value < target
    return None  # a figure without a target


def _runner(section: str, mode: str, peer: bool) -> Callable[[], dict[str, Any]]:
    mod = importlib.import_module(MODULES[section])
    fn: Callable[..., dict[str, Any]] = mod.run
    quick = mode == "quick"
    if section == "vs_dynamo" or section == "service":
        return lambda: fn(quick, smoke=mode == "smoke", peer=peer)
    return lambda: fn(quick)


def run(mode: str = "full", *, peer: bool = True, only: list[str] | None = None,
        skip: list[str] | None = None) -> dict[str, Any]:
    """Run the sections; never raises for a failing section (it is recorded under errors)."""
    started = time.time()
    res: dict[str, Any] = {"mode": mode, "machine": machine(),
                           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    errors: dict[str, str] = {}
    notes: list[str] = []
    sections = [s for s in (only or SECTIONS) if s not in (skip or [])]
    if peer:
        try:
            common.ensure_peer_venv()
        except common.PeerUnavailable as e:
            if mode != "smoke":
                raise
            peer = False
            msg = (f"!!! Dynamo peer UNAVAILABLE ({e}); smoke runs OUR side against the oracle "
                   "only. Dynamo's answers were NOT checked. !!!")
            notes.append(msg)
            common.log(msg)
    res["peer"] = f"{common.DYNAMO_PACKAGE}=={common.DYNAMO_VERSION}" if peer else None
    timings: dict[str, float] = {}
    for section in sections:
        t0 = time.monotonic()
        try:
            if mode == "smoke" and section not in ("vs_dynamo", "service"):
                importlib.import_module(MODULES[section])  # imports must work; no timing
                continue
            if mode == "smoke" and section == "service" and not peer:
                continue
            common.log(f"== {section}")
            res.update(_runner(section, mode, peer)())
        except ModuleNotFoundError as e:
            if e.name == MODULES[section]:
                errors[section] = "not available in this tree (landing)"
            else:
                errors[section] = f"{type(e).__name__}: {e}"
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as e:
            errors[section] = f"{type(e).__name__}: {e}"
            common.log(f"{section} failed:\n{traceback.format_exc()}")
        finally:
            timings[section] = round(time.monotonic() - t0, 1)
    for key in REQUIRED_KEYS:
        res.setdefault(key, None)
    res["targets"] = {
        key: {"target": f"{op} {target:g}{unit}" if op else "—", "value": res.get(key),
              "met": _met(key, res.get(key))}
        for key, (op, target, unit, _what) in TARGETS.items()
    }
    res["machine"]["loadavg_end"] = list(os.getloadavg())
    res["section_seconds"] = timings
    res["duration_s"] = round(time.time() - started, 1)
    res["errors"] = errors
    res["notes"] = notes
    return res


def _fmt(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.2f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def print_tables(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 150)
    m = res["machine"]
    t = Table(title=f"inferencecache benchmarks ({res['mode']}) — {m['cores']} cores, "
              f"{m['cpu']}, load {m['loadavg_start'][0]:.1f}→{m['loadavg_end'][0]:.1f}")
    t.add_column("figure")
    t.add_column("value", justify="right")
    t.add_column("target", justify="right")
    t.add_column("", justify="center")
    t.add_column("what")
    for key, (_op, _target, _unit, what) in TARGETS.items():
        tg = res["targets"][key]
        mark = {True: "[green]met[/]", False: "[red]missed[/]", None: "—"}[tg["met"]]
        t.add_row(key, _fmt(res.get(key)), tg["target"], mark, what)
    console.print(t)
    d = Table(title="context")
    d.add_column("figure")
    d.add_column("value", justify="right")
    d.add_column("key")
    for key, label in DETAILS:
        if res.get(key) is not None:
            d.add_row(label, _fmt(res[key]), key)
    console.print(d)
    for section, err in res["errors"].items():
        console.print(f"[red]{section}: {err}[/]")
    for note in res["notes"]:
        console.print(f"[bold red]{note}[/]")
    checks = [k for k in ("inproc_correct", "service_correct") if k in res]
    for k in checks:
        console.print(f"{k}: {res[k]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="≤ 10 minutes on 2 cores")
    g.add_argument("--smoke", action="store_true", help="tiny; correctness only (CI)")
    ap.add_argument("--json", metavar="FILE", help="also write the JSON here ('-' = stdout)")
    ap.add_argument("--no-peer", action="store_true", help="skip Dynamo (our side only)")
    ap.add_argument("--only", help=f"comma-separated sections of {','.join(SECTIONS)}")
    ap.add_argument("--skip", help="comma-separated sections to skip")
    args = ap.parse_args(argv)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    only = args.only.split(",") if args.only else None
    skip = args.skip.split(",") if args.skip else None
    for s in (only or []) + (skip or []):
        if s not in SECTIONS:
            ap.error(f"unknown section {s!r} (choose from {', '.join(SECTIONS)})")
    with common.sigterm_as_exit():
        res = run(mode, peer=not args.no_peer, only=only, skip=skip)
    text = json.dumps(res, indent=2, default=str)
    out_dir = common.BENCH_DIR / "results"
    out_dir.mkdir(exist_ok=True)
    (out_dir / f"run-{mode}-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(text + "\n")
    if args.json == "-":
        print(text)
    else:
        if args.json:
            Path(args.json).write_text(text + "\n")
        print_tables(res)
    failed = bool(res["errors"]) or res.get("inproc_correct") is False or \
        res.get("service_correct") is False
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

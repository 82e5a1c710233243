"""``inferencecache demo``: the whole system on loopback, one routing policy after another.

Starts, as child processes on 127.0.0.1 with ports chosen at run time: the server, N simulated
engines (``fake-engine --mode simulated``) each with a real subscriber, and, per policy, a
gateway with that ``--routing-policy``. For each policy it resets every engine's prefix cache
(``/reset_prefix_cache`` → AllBlocksCleared → ALL_CLEARED at the server), starts a fresh gateway
(so the history router starts empty too), replays the same seeded workload through the gateway
with the requests' own arrival times (streaming, token-id prompts), and measures TTFT at the
client, the hint overhead from the gateway's ``X-Cache-Route-Hint-Us`` / ``-Oracle-Us`` headers,
and the hit rate from the engines' own ``vllm:prefix_cache_*`` counters. Every child is stopped by
its PID at the end, on failure and on Ctrl-C/SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from inferencecache.engines.simulated import EngineParams
from inferencecache.procs import Child, ChildFailed, Children, RedisServer
from inferencecache.sim import cluster, report
from inferencecache.sim.simulator import replica_names, warmup_tokens
from inferencecache.sim.workloads import Request, WorkloadSpec, adapters_of, generate
from inferencecache.subscriber.engine_stats import HITS, QUERIES

START_TIMEOUT = 30.0
_COUNTER = re.compile(
    rb"^(%s|%s)_total\{[^}]*\}\s+([0-9.eE+-]+)"
    % (re.escape(HITS).encode(), re.escape(QUERIES).encode()),
    re.MULTILINE,
)
_HITS = HITS.encode()


@dataclass(frozen=True, slots=True)
class DemoPlan:
    """Everything one demo run does (built from the command's flags)."""

    workload: WorkloadSpec
    policies: tuple[str, ...]
    replicas: int
    engine: EngineParams
    gateways: int = 1
    policy_params: dict[str, dict[str, Any]] = field(default_factory=dict)
    duration: float = 0.0  # 0 = send every request; else only those arriving before it
    out: Path = Path("demo-out")
    event_log: bool = False  # the server on a private Redis log; + cache_aware in process

    @property
    def runs(self) -> tuple[str, ...]:
        """The rows of the run: the policies, and with ``event_log`` the in-process variant of
        cache_aware right after it."""
        if not self.event_log or "cache_aware" not in self.policies:
            return self.policies
        out: list[str] = []
        for p in self.policies:
            out.append(p)
            if p == "cache_aware":
                out.append(IN_PROCESS)
        return tuple(out)


IN_PROCESS = "cache_aware (in-process replica)"
"""The demo row of ``gateway --event-log``: cache_aware asking a replica in its own process."""


@dataclass(slots=True)
class Outcome:
    ok: bool
    ttft_s: float = 0.0
    hint_s: float | None = None
    replica: str = ""
    reason: str = ""


@dataclass(slots=True)
class Cluster:
    """The long-lived children: server, engines, subscribers."""

    grpc: str = ""
    server_http: str = ""
    lookup_http: str = ""  # the server's HTTP lookup listener (the gateways' hint path)
    engines: dict[str, str] = field(default_factory=dict)  # replica -> http host:port
    event_log: str = ""  # the private Redis's URL with DemoPlan.event_log


def _addr(rec: dict[str, Any], key: str) -> str:
    value = rec.get(key)
    if not isinstance(value, str) or not value:
        raise ChildFailed(f"startup log has no {key!r}: {rec}")
    return value


def _start(children: Children, name: str, args: list[str]) -> Child:
    """One child in its own session: a Ctrl-C in the terminal reaches the demo only, and the
    demo shuts its children down."""
    return children.start(*args, name=name, new_session=True)


def start_cluster(plan: DemoPlan, children: Children, event_log: str = "") -> Cluster:
    """Server + engines (in parallel), then one subscriber per engine."""
    eng = plan.engine
    c = Cluster(event_log=event_log)
    server = _start(children, "server", [
        "serve", "--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0",
        "--lookup-http-address", "127.0.0.1:0", "--block-size", str(eng.block_size),
        *(["--event-log", event_log] if event_log else []),
    ])
    adapters = adapters_of(plan.workload)
    lora = ",".join(f"{i + 1}={a}" for i, a in enumerate(adapters))
    names = replica_names(plan.replicas)
    engines: list[tuple[str, Child]] = []
    for name in names:
        args = [
            "fake-engine", "--mode", "simulated",
            "--bind", "tcp://127.0.0.1:0", "--http-address", "127.0.0.1:0",
            "--model-name", plan.workload.model,
            "--block-size", str(eng.block_size),
            "--gpu-blocks", str(eng.num_blocks),
            "--max-num-seqs", str(eng.max_num_seqs),
            "--prefill-ms-per-token", str(eng.prefill_ms_per_token),
            "--prefill-base-ms", str(eng.prefill_base_ms),
            "--decode-ms-per-token", str(eng.decode_ms_per_token),
        ]
        if lora:
            args += ["--lora-adapters", lora]
        engines.append((name, _start(children, name, args)))
    rec = server.wait_log("serving", START_TIMEOUT)
    c.grpc = _addr(rec, "grpc_address")
    c.server_http = _addr(rec, "http_address")
    c.lookup_http = _addr(rec, "lookup_http_address")
    zmq_endpoints: dict[str, str] = {}
    for name, child in engines:
        rec = child.wait_log("simulated engine ready", START_TIMEOUT)
        zmq_endpoints[name] = _addr(rec, "endpoint")
        c.engines[name] = _addr(rec, "http_address")
    subs: list[Child] = []
    for name in names:
        subs.append(_start(children, f"subscriber-{name}", [
            "subscribe",
            "--engine-endpoint", zmq_endpoints[name],
            "--server", c.grpc,
            "--replica-id", name,
            "--model-id", plan.workload.model,
            "--tenant-id", cluster.TENANT,
            "--block-size", str(eng.block_size),
            "--engine-metrics-url", f"http://{c.engines[name]}/metrics",
            "--engine-models-url", f"http://{c.engines[name]}/v1/models",
            "--stats-interval", f"{cluster.STATS_INTERVAL_S:g}s",
            "--max-concurrency-ceiling", str(cluster.max_concurrency_ceiling(eng)),
            "--metrics-address", "127.0.0.1:0",
        ]))
    for sub in subs:
        sub.wait_log("subscribed to engine KV events", START_TIMEOUT)
    return c


def spawn_gateway(plan: DemoPlan, c: Cluster, children: Children, policy: str) -> Child:
    """Start one gateway process (its address comes from :func:`gateway_address`)."""
    engines = ",".join(f"{n}=http://{a}" for n, a in c.engines.items())
    in_process = policy == IN_PROCESS
    base = "cache_aware" if in_process else policy
    args = [
        "gateway", "--engines", engines, "--server", c.grpc,
        "--http-address", "127.0.0.1:0", "--routing-policy", base,
        "--block-size", str(plan.engine.block_size), "--tenant-id", cluster.TENANT,
    ]
    # hints from an in-process event-log replica, else over HTTP (the cheaper hop)
    args += ["--event-log", c.event_log] if in_process else ["--lookup-url", f"http://{c.lookup_http}"]
    params = plan.policy_params.get(base)
    if params:
        args += ["--routing-params", cluster.format_params(params)]
    return _start(children, f"gateway-{'cache_aware-replica' if in_process else policy}", args)


def gateway_address(child: Child) -> str:
    return _addr(child.wait_log("serving", START_TIMEOUT), "http_address")


def start_gateways(plan: DemoPlan, c: Cluster, children: Children) -> dict[str, list[Child]]:
    """Every policy's gateways at once (they idle until their turn), ready when this returns."""
    out = {p: [spawn_gateway(plan, c, children, p) for _ in range(plan.gateways)]
           for p in plan.runs}
    for kids in out.values():
        for child in kids:
            gateway_address(child)
    return out


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, bytes]:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
        return r.status, await r.read()


async def engine_counters(session: aiohttp.ClientSession, c: Cluster) -> tuple[float, float]:
    """Σ prefix-cache hit tokens and Σ queried tokens over every engine."""
    hits = queries = 0.0
    for addr in c.engines.values():
        _, body = await _get(session, f"http://{addr}/metrics")
        for name, value in _COUNTER.findall(body):
            if name == _HITS:
                hits += float(value)
            else:
                queries += float(value)
    return hits, queries


async def wait_ready(session: aiohttp.ClientSession, gateway: str, models: Sequence[str]) -> None:
    """Until the gateway is ready and resolves every model the workload names (bounded)."""
    deadline = time.monotonic() + START_TIMEOUT
    want = set(models)
    while True:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            status, body = await _get(session, f"http://{gateway}/v1/models")
            if status == 200:
                have = {m.get("id") for m in json.loads(body).get("data", [])}
                if want <= have:
                    return
        if time.monotonic() > deadline:
            raise ChildFailed(f"gateway at {gateway} never listed the models {sorted(want)}")
        await asyncio.sleep(0.1)


async def reset_engines(session: aiohttp.ClientSession, c: Cluster) -> None:
    for addr in c.engines.values():
        async with session.post(f"http://{addr}/reset_prefix_cache") as r:
            if r.status != 200:
                raise ChildFailed(f"engine at {addr}: /reset_prefix_cache answered {r.status}")


async def warm_up(session: aiohttp.ClientSession, c: Cluster, model: str) -> None:
    """One short request straight to each engine, so the index knows every replica before the
    first routed request (the simulator does the same; docs/demo.md explains why)."""
    for name, addr in c.engines.items():
        body = {"model": model, "prompt": warmup_tokens(name).tolist(), "max_tokens": 1}
        async with session.post(f"http://{addr}/v1/completions", json=body) as r:
            await r.read()
            if r.status != 200:
                raise ChildFailed(f"engine {name}: warm-up request answered {r.status}")


async def one_request(
    session: aiohttp.ClientSession, url: str, body: bytes
) -> Outcome:
    """One streaming completion; TTFT = first SSE data chunk - send."""
    t0 = time.perf_counter()
    try:
        async with session.post(url, data=body,
                                headers={"Content-Type": "application/json"}) as r:
            if r.status != 200:
                await r.read()
                return Outcome(False)
            hint_us = r.headers.get("X-Cache-Route-Hint-Us") or r.headers.get(
                "X-Cache-Route-Oracle-Us"
            )
            ttft = 0.0
            async for line in r.content:
                if line.startswith(b"data: "):
                    ttft = time.perf_counter() - t0
                    break
            await r.read()
            return Outcome(
                ttft > 0,
                ttft,
                int(hint_us) / 1e6 if hint_us and hint_us.isdigit() else None,
                r.headers.get("X-Cache-Route-Replica", ""),
                r.headers.get("X-Cache-Route-Reason", ""),
            )
    except (aiohttp.ClientError, TimeoutError):
        return Outcome(False)


async def drive(
    session: aiohttp.ClientSession,
    gateways: Sequence[str],
    requests: Sequence[Request],
    bodies: Sequence[bytes],
    on_done: Callable[[], None],
) -> list[Outcome]:
    """Send every request at its arrival time (open loop), alternating over the gateways like
    an L4 load balancer; wait for every answer."""
    urls = [f"http://{g}/v1/completions" for g in gateways]
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.05
    tasks: list[asyncio.Task[Outcome]] = []

    async def run(url: str, body: bytes) -> Outcome:
        out = await one_request(session, url, body)
        on_done()
        return out

    for req, body in zip(requests, bodies, strict=True):
        delay = start + req.arrival - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        url = urls[req.index % len(urls)]
        tasks.append(asyncio.create_task(run(url, body)))
    return list(await asyncio.gather(*tasks))


def summarize(outcomes: Sequence[Outcome], hits: float, queries: float) -> dict[str, float | int]:
    ok = [o for o in outcomes if o.ok]
    hints = [o.hint_s for o in ok if o.hint_s is not None]
    hit_rate = hits / queries if queries > 0 else 0.0
    return report.summary(hit_rate, [o.ttft_s for o in ok], hints, len(ok))


async def run_policies(
    plan: DemoPlan, c: Cluster, children: Children, console: Console
) -> dict[str, Any]:
    requests = list(generate(plan.workload))
    if plan.duration > 0:
        requests = [r for r in requests if r.arrival < plan.duration]
    bodies = [
        json.dumps({"model": r.model, "prompt": r.tokens.tolist(),
                    "max_tokens": r.max_tokens, "stream": True}).encode()
        for r in requests
    ]
    models = sorted({r.model for r in requests})
    results: dict[str, dict[str, float | int]] = {}
    errors: dict[str, int] = {}
    progress = Progress(
        TextColumn("{task.description:<12}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), TextColumn("{task.fields[note]}"), console=console,
    )
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        with progress:
            tasks = {
                p: progress.add_task(p, total=len(requests), note="waiting", start=False)
                for p in plan.runs
            }
            all_gateways = await asyncio.to_thread(start_gateways, plan, c, children)
            for policy in plan.runs:
                task = tasks[policy]
                progress.start_task(task)
                progress.update(task, note="resetting engines")
                gateways = all_gateways[policy]
                gws = [gateway_address(g) for g in gateways]
                try:
                    for gw in gws:
                        await wait_ready(session, gw, models)
                    await reset_engines(session, c)
                    await warm_up(session, c, plan.workload.model)
                    await asyncio.sleep(0.5)  # ALL_CLEARED and the warm-up adds reach the server
                    h0, q0 = await engine_counters(session, c)
                    progress.update(task, note="running")
                    outcomes = await drive(
                        session, gws, requests, bodies, functools.partial(progress.advance, task)
                    )
                    h1, q1 = await engine_counters(session, c)
                finally:
                    for gw_child in gateways:  # its turn is over: free the CPU
                        await asyncio.to_thread(children.stop, gw_child)
                results[policy] = summarize(outcomes, h1 - h0, q1 - q0)
                errors[policy] = sum(1 for o in outcomes if not o.ok)
                s = results[policy]
                progress.update(
                    task,
                    note=f"hit {float(s['hit_rate']):.1%}  p90 {float(s['ttft_p90_ms']):.0f} ms"
                    + (f"  [red]{errors[policy]} failed[/red]" if errors[policy] else ""),
                )
    return report.document(plan.workload.name, results)


def run(plan: DemoPlan, console: Console | None = None) -> int:
    """The demo; returns the exit code. Every child is stopped whatever happens."""
    console = console or Console()
    children = Children(stop_timeout=5.0, together=True)  # SIGTERM to all: parallel shutdown
    started = time.monotonic()
    cleanup: list[Callable[[], None]] = []  # after the children: the private Redis, its dir

    async def main() -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        assert me is not None
        loop.add_signal_handler(signal.SIGTERM, me.cancel)
        console.print(
            f"[bold]inferencecache demo[/bold]: workload [cyan]{plan.workload.name}[/cyan], "
            f"{len(plan.policies)} policies, {plan.replicas} engines, "
            f"{plan.workload.requests} requests at {plan.workload.rate:g}/s each"
        )
        with console.status("starting server, engines and subscribers"):
            url = ""
            if plan.event_log:
                redis_dir = tempfile.mkdtemp(prefix="inferencecache-demo-redis-")
                cleanup.append(lambda: shutil.rmtree(redis_dir, ignore_errors=True))
                redis_srv = RedisServer(redis_dir)
                cleanup.insert(0, redis_srv.stop)
                await asyncio.to_thread(redis_srv.start)
                url = redis_srv.url
            c = await asyncio.to_thread(start_cluster, plan, children, url)
        console.print(
            f"cluster up in {time.monotonic() - started:.1f}s: server {c.grpc}, engines "
            + ", ".join(f"{n}={a}" for n, a in c.engines.items())
        )
        return await run_policies(plan, c, children, console)

    try:
        doc = asyncio.run(main())
    except (KeyboardInterrupt, asyncio.CancelledError):
        console.print("[yellow]interrupted; stopping every process[/yellow]")
        return 130  # the finally below stops every child before this returns
    except ChildFailed as e:
        console.print(f"[red]demo failed:[/red] {e}")
        return 1
    finally:
        try:
            children.stop_all()
        finally:
            for fn in cleanup:
                fn()
    out = plan.out
    json_path = report.write_json(out / "results.json", doc)
    title = (f"inferencecache demo: {plan.workload.name}, {plan.replicas} engines, "
             f"{plan.workload.requests} requests at {plan.workload.rate:g}/s")
    png_path = report.plot([doc], out / "results.png", title)
    console.print(report.table(doc, title))
    console.print(report.targets_table([doc]))
    load = os.getloadavg()
    console.print(
        f"machine load average (1/5/15 min): {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on "
        f"{os.cpu_count()} cores; TTFT and hint overhead grow with CPU contention"
    )
    console.print(
        f"wrote {json_path} and {png_path} in {time.monotonic() - started:.0f}s; "
        f"every process it started is stopped"
    )
    return 0

"""The cluster simulator: routing policies over simulated engines, in simulated time.

A discrete-event loop with no sockets and no sleeping. What runs is the real code everywhere it
matters: the routing policies (:mod:`inferencecache.routing`), the engine model shared with the
simulated engine server (:class:`~inferencecache.engines.simulated.EngineModel`), the
subscriber's block → fingerprint mapping (:class:`~inferencecache.subscriber.mapping.BlockMapper`)
and the index (:class:`~inferencecache.index.Index` + :class:`~inferencecache.index.Router`).
The subscriber's refresh of resident blocks and its adapter lifecycle tracking are the real code
too: each replica has a :class:`~inferencecache.subscriber.refresh.RefreshPacer` (ticked when it
asks, gated by an :class:`~inferencecache.subscriber.refresh.EngineLiveness` that the stats ticks
feed) and an :class:`~inferencecache.subscriber.adapters.AdapterTracker` fed every
``adapter_poll_s`` with what the engine serves (``workloads.AdapterSchedule``), exactly as the
subscriber feeds them from its clock and ``/v1/models``. The index runs its TTL sweep every 60 s.
What is modelled: the subscriber's add window (adds reach the index at the next window tick plus a
transport delay; evictions and clears after the transport delay, adds first), its stats reports
(every ``stats_interval``: pressure = engine load / ``max_concurrency_ceiling``, hit rate from the
counter deltas), and the gateway's in-flight count (passed to every policy as ``load``).
Per-window results (hit rate, TTFT) are kept by request arrival (``PolicyResult.windows``).

Per request: fingerprint the prompt, ask the hint plane (``cache_aware``) or read every engine's
cache (``oracle``), let the policy choose, submit to that engine. An engine admits up to
``max_num_seqs`` sequences, prefills the uncached tokens in FIFO order, and frees the slot after
decoding; TTFT = first token time - arrival.
"""

from __future__ import annotations

import array
import functools
import heapq
import math
import random
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from inferencecache import fingerprint
from inferencecache.engines.simulated import Admitted, EngineModel, EngineParams
from inferencecache.index import (
    Event,
    EventType,
    FakeClock,
    Index,
    IndexSettings,
    LookupRequest,
    Prefix,
    Router,
    Stats,
    Update,
)
from inferencecache.kvevents.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
)
from inferencecache.routing import Hint, RouteInput, RoutingPolicy, make_policy
from inferencecache.sim import report
from inferencecache.sim.workloads import (
    AdapterSchedule,
    Request,
    WorkloadSpec,
    adapter_schedule,
    generate,
    served_name,
)
from inferencecache.subscriber.adapters import AdapterTracker
from inferencecache.subscriber.engine_stats import delta_hit_rate, pressure
from inferencecache.subscriber.lora import LoraResolver
from inferencecache.subscriber.mapping import BlockMapper
from inferencecache.subscriber.messages import Entry
from inferencecache.subscriber.metrics import SubscriberMetrics
from inferencecache.subscriber.refresh import (
    DEFAULT_INTERVAL,
    LIVENESS_PROBES,
    EngineLiveness,
    RefreshPacer,
    refresh_step,
)
from inferencecache.subscriber.settings import DEFAULT_ADAPTER_POLL_INTERVAL

EPOCH_US = 1_700_000_000_000_000
"""Wall-clock time (µs) of simulated time 0 for the index's clock."""
WARMUP_S = 1.0
"""The workload starts this long after the warm-up requests."""
WARMUP_TOKENS = 32
SWEEP_S = 60.0
"""The index's TTL sweep interval (the server's default --sweep-interval)."""
DEFAULT_ADAPTER_POLL_S = DEFAULT_ADAPTER_POLL_INTERVAL
DEFAULT_SERIES_WINDOW_S = 600.0
"""Per-window results every 10 simulated minutes."""


def _wall_us(t: float) -> int:
    """The index clock's wall time (µs) at simulated time ``t`` (seconds)."""
    return EPOCH_US + int(t * 1_000_000)


def warmup_tokens(replica: str) -> array.array[int]:
    """The warm-up prompt of one replica (unique to it, shared with no workload)."""
    return array.array("I", random.Random(f"warmup:{replica}").choices(range(65_536), k=32))


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulated run: a workload through one policy over ``replicas`` engines."""

    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    policy: str = "cache_aware"
    policy_params: tuple[tuple[str, Any], ...] = ()
    replicas: int = 4
    engine: EngineParams = field(default_factory=EngineParams)
    tenant_id: str = "default"  # the index tenant every subscriber reports under
    hash_scheme: str = "vllm"
    window_s: float = 0.1  # subscriber add window (--window)
    transport_s: float = 0.002  # subscriber -> server delivery delay
    stats_interval_s: float = 1.0  # subscriber --stats-interval
    max_concurrency_ceiling: int = 16  # subscriber --max-concurrency-ceiling
    pressure_weight: float = 1.0  # server --pressure-weight
    gateways: int = 1  # gateway replicas, each with its own policy state and in-flight counts
    # One short request per engine before the workload (as the demo does), so the index knows
    # every replica before the first routed request; the workload starts WARMUP_S later.
    warmup: bool = True
    refresh_interval_s: float = DEFAULT_INTERVAL  # subscriber --refresh-interval (0: off)
    adapter_poll_s: float = DEFAULT_ADAPTER_POLL_S  # subscriber --adapter-poll-interval (0: off)
    series_window_s: float = DEFAULT_SERIES_WINDOW_S  # per-window results (by arrival)
    ttl_s: float = 1800.0  # server --default-ttl

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("replicas must be >= 1")
        if self.gateways < 1:
            raise ValueError("gateways must be >= 1")
        for name in ("window_s", "transport_s", "stats_interval_s", "refresh_interval_s",
                     "adapter_poll_s"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a non-negative number")
        if self.window_s <= 0 or self.stats_interval_s <= 0:
            raise ValueError("window_s and stats_interval_s must be positive")
        for name in ("series_window_s", "ttl_s"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a positive number")


@dataclass(slots=True)
class Window:
    """What one series window measured (requests by arrival time)."""

    start_s: float
    requests: int = 0
    hit_tokens: int = 0
    query_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    stale_hints: int = 0  # hints naming more tokens than the replica held (see PolicyResult)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass(slots=True)
class PolicyResult:
    """What one run measured; ``summary()`` is the demo's JSON entry for the policy."""

    policy: str
    requests: int = 0
    hit_tokens: int = 0
    query_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    hint_s: list[float] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)
    per_replica: dict[str, int] = field(default_factory=dict)
    evicted_blocks: int = 0
    rejected: int = 0  # requests the engine refused (prompt larger than its whole cache)
    sim_seconds: float = 0.0
    wall_seconds: float = 0.0
    windows: list[Window] = field(default_factory=list)
    window_s: float = DEFAULT_SERIES_WINDOW_S
    workload_seconds: float = 0.0  # workload time covered: the duration, or the last arrival
    refreshed_entries: int = 0  # entries re-reported by the replicas' refreshers
    adapters_forgotten: int = 0  # adapter partitions dropped by the replicas' trackers
    # PREFIX_MATCH answers whose first replica held fewer of the prompt's leading blocks than
    # the hint said when the request was routed (the index lags, or holds what is gone)
    stale_hints: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def summary(self) -> dict[str, float | int]:
        return report.summary(self.hit_rate, self.ttft_s, self.hint_s, self.requests)

    def series(self) -> list[dict[str, float | int]]:
        """The per-window rows of the JSON document (``report.series_row``)."""
        end = self.workload_seconds
        return [report.series_row(w.start_s, min(self.window_s, max(0.0, end - w.start_s)),
                                  w.hit_rate, w.ttft_s, w.requests, w.stale_hints)
                for w in self.windows]


def replica_names(n: int) -> list[str]:
    """``engine-0`` .. in an order that sorts like the index (zero padded past 10)."""
    width = len(str(n - 1))
    return [f"engine-{i:0{width}d}" for i in range(n)]


# ---------------------------------------------------------------------------------------------
# The subscriber's side: window, transport delay, stats


class _Delivery:
    """Index calls in flight from the subscribers, applied when their time has come."""

    def __init__(self, index: Index, clock: FakeClock) -> None:
        self.index = index
        self.clock = clock
        self.queue: deque[tuple[float, Callable[[], None]]] = deque()

    def at(self, due: float, fn: Callable[[], None]) -> None:
        self.queue.append((due, fn))

    def run_until(self, t: float) -> None:
        q = self.queue
        clock = self.clock
        while q and q[0][0] <= t:
            due, fn = q.popleft()
            clock.set_now_us(_wall_us(due))
            fn()


class _SimOutbox:
    """The subscriber forwarder's behaviour (engine-events-and-subscriber.md §3.5) in simulated
    time."""

    def __init__(self, replica: str, cfg: SimConfig, model_id: str, delivery: _Delivery) -> None:
        self.replica = replica
        self.cfg = cfg
        self.model_id = model_id
        self.delivery = delivery
        self.pending: list[Entry] = []
        # (prefix, adapter) evictions of the current batch; adapter None = ALL_CLEARED
        self.evictions: list[tuple[bytes, str | None]] = []
        self.now = 0.0
        self.refreshed = 0

    def _update(self, entries: list[Entry]) -> Callable[[], None]:
        cfg = self.cfg
        upd = Update(
            replica_id=self.replica,
            model_id=self.model_id,
            tenant_id=cfg.tenant_id,
            hash_scheme=cfg.hash_scheme,
            prefixes=[Prefix(prefix_hash=p, token_count=n, tier=t, adapter_id=a)
                      for p, n, a, t in entries],
        )
        index = self.delivery.index
        return lambda: index.apply_update(upd)

    def add_many(self, entries: list[Entry], ts_us: int) -> None:
        self.pending.extend(entries)

    def flush(self) -> None:
        if self.pending:
            entries, self.pending = self.pending, []
            self.delivery.at(self.now + self.cfg.transport_s, self._update(entries))

    def report(self, entries: list[Entry], ts_us: int) -> None:
        self.delivery.at(self.now + self.cfg.transport_s, self._update(list(entries)))

    def evict(self, prefix: bytes, adapter: str, ts_us: int) -> None:
        self.evictions.append((prefix, adapter))

    def clear(self, ts_us: int) -> None:
        self.pending = []
        self.evictions.append((b"", None))

    def refresh(self, entries: list[Entry]) -> None:
        """Like the forwarder: pending adds at "now", out with the next window's flush."""
        self.refreshed += len(entries)
        self.pending.extend(entries)

    def end_batch(self) -> None:
        """Deliver this batch's evictions (and clears) as one step, after its adds."""
        if not self.evictions:
            return
        todo, self.evictions = self.evictions, []
        cfg = self.cfg
        events = [
            Event(
                type=EventType.ALL_CLEARED if adapter is None else EventType.PREFIX_EVICTED,
                replica_id=self.replica,
                model_id=self.model_id,
                tenant_id=cfg.tenant_id,
                prefix_hash=prefix,
                adapter_id=adapter or "",
            )
            for prefix, adapter in todo
        ]
        index = self.delivery.index

        def apply() -> None:
            for ev in events:
                index.apply_event(ev)

        self.delivery.at(self.now + cfg.transport_s, apply)


class _Replica:
    """One simulated engine with its subscriber (mapper, refresher, adapter tracker)."""

    def __init__(self, name: str, cfg: SimConfig, model_id: str, delivery: _Delivery | None):
        self.name = name
        self.engine: EngineModel[int] = EngineModel(cfg.engine)
        self.outbox: _SimOutbox | None = None
        self.mapper: BlockMapper | None = None
        self.pacer: RefreshPacer | None = None
        self.refresh_due = 0.0
        self.tracker: AdapterTracker | None = None
        self.forgotten = 0
        # The subscriber's liveness rule, fed by the stats ticks (its HTTP probe); the engine's
        # socket never drops in the simulation.
        self.liveness = EngineLiveness(LIVENESS_PROBES * cfg.stats_interval_s)
        if delivery is not None:
            self.outbox = _SimOutbox(name, cfg, model_id, delivery)
            self.metrics = SubscriberMetrics()
            self.mapper = BlockMapper(
                block_size=cfg.engine.block_size,
                resolver=LoraResolver({}),
                outbox=self.outbox,
                metrics=self.metrics,
            )
            if cfg.refresh_interval_s > 0:
                self.pacer = RefreshPacer(cfg.refresh_interval_s)
            if cfg.adapter_poll_s > 0:
                self.tracker = AdapterTracker(self.mapper, self.metrics)
        self.last_hits = 0
        self.last_queries = 0
        self.stats_seen = False

    def publish(self, adm: Admitted[int], adapter: str, now: float) -> None:
        """The engine's KV events for one admission, through the real subscriber mapping."""
        mapper = self.mapper
        if mapper is None:
            return
        ins = adm.inserted
        # One BlockRemoved for all of them (the server sees one PREFIX_EVICTED per block either
        # way; the engine server publishes one hash per event, as vLLM does).
        events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        if ins.evicted:
            events.append(BlockRemoved([h.to_bytes(8, "big") for h in ins.evicted], "GPU", 0))
        if ins.stored:
            events.append(
                BlockStored(
                    [h.to_bytes(8, "big") for h in ins.stored],
                    None if ins.parent is None else ins.parent.to_bytes(8, "big"),
                    ins.stored_tokens,
                    self.engine.block_size,
                    lora_name=served_name(adapter) or None,
                    medium="GPU",
                    group_idx=0,
                    kv_cache_spec_kind="full_attention",
                )
            )
        if events:
            assert self.outbox is not None
            self.outbox.now = now
            mapper.apply(DecodedBatch(0.0, events))
            self.outbox.end_batch()

    def refresh(self, now: float) -> None:
        """The subscriber's refresher, due at ``now``."""
        if self.pacer is None or self.mapper is None or self.outbox is None:
            self.refresh_due = math.inf
            return
        self.outbox.now = now
        _alive, self.refresh_due = refresh_step(self.pacer, self.mapper, self.liveness, now)

    def poll_adapters(self, now: float, served: dict[str, str]) -> None:
        """The subscriber's adapter poll at ``now`` against what the engine serves."""
        if self.tracker is None or self.outbox is None:
            return
        self.outbox.now = now
        self.forgotten += len(self.tracker.observe(self.tracker.begin(), served))
        self.outbox.end_batch()


# ---------------------------------------------------------------------------------------------


_ARRIVAL = 0
_FINISH = 1


class Simulator:
    """Runs one :class:`SimConfig` to completion (``run``)."""

    def __init__(self, cfg: SimConfig, requests: Iterable[Request] | None = None) -> None:
        self.cfg = cfg
        params = dict(cfg.policy_params)
        self.policies: list[RoutingPolicy] = [
            make_policy(cfg.policy, **params) for _ in range(cfg.gateways)
        ]
        self.policy = self.policies[0]
        self.names = replica_names(cfg.replicas)
        self.model_id = cfg.workload.model
        self.clock = FakeClock(now_us=EPOCH_US)
        self.index: Index | None = None
        self.router: Router | None = None
        delivery: _Delivery | None = None
        if self.policy.needs_hint:
            self.index = Index(
                IndexSettings(
                    engine_block_size=cfg.engine.block_size,
                    pressure_weight=cfg.pressure_weight,
                    default_ttl=cfg.ttl_s,
                ),
                clock=self.clock,
            )
            self.router = Router(self.index)
            delivery = _Delivery(self.index, self.clock)
        self.delivery = delivery
        self.replicas = [_Replica(n, cfg, self.model_id, delivery) for n in self.names]
        self.by_name = {r.name: r for r in self.replicas}
        self.requests = requests if requests is not None else generate(cfg.workload)
        self.result = PolicyResult(cfg.policy, window_s=cfg.series_window_s)
        self.schedule: AdapterSchedule = adapter_schedule(cfg.workload)
        self._next_window = cfg.window_s
        self._next_stats = cfg.stats_interval_s
        self._next_sweep = SWEEP_S
        self._next_refresh = 0.0 if any(r.pacer for r in self.replicas) else math.inf
        self._next_poll = 0.0 if any(r.tracker for r in self.replicas) else math.inf
        self._offset = WARMUP_S if cfg.warmup else 0.0

    # -- the subscriber's periodic work -----------------------------------------------------------

    def _advance(self, t: float) -> None:
        """Run window flushes, stats reports and sweeps due at or before ``t``, then deliver."""
        delivery = self.delivery
        if delivery is None:
            return
        cfg = self.cfg
        while True:
            nxt = min(self._next_window, self._next_stats, self._next_sweep, self._next_refresh,
                      self._next_poll)
            if nxt > t:
                break
            if nxt == self._next_refresh:
                delivery.run_until(nxt)
                for r in self.replicas:
                    if r.refresh_due <= nxt:
                        r.refresh(nxt)
                self._next_refresh = min(r.refresh_due for r in self.replicas)
            elif nxt == self._next_poll:
                delivery.run_until(nxt)
                served = self.schedule.served(nxt - self._offset)
                for r in self.replicas:
                    r.poll_adapters(nxt, served)
                self._next_poll += cfg.adapter_poll_s
            elif nxt == self._next_window:
                delivery.run_until(nxt)
                for r in self.replicas:
                    ob = r.outbox
                    if ob is not None and ob.pending:
                        ob.now = nxt
                        ob.flush()
                self._next_window += cfg.window_s
            elif nxt == self._next_stats:
                delivery.run_until(nxt)
                self._report_stats(nxt)
                self._next_stats += cfg.stats_interval_s
            else:
                delivery.run_until(nxt)
                self.clock.set_now_us(_wall_us(nxt))
                assert self.index is not None
                self.index.sweep()
                self._next_sweep += SWEEP_S
        delivery.run_until(t)

    def drain(self) -> None:
        """Flush every subscriber's pending adds and deliver everything in flight (tests)."""
        delivery = self.delivery
        if delivery is None:
            return
        t = max([self._next_window, *(due for due, _ in delivery.queue)])
        for r in self.replicas:
            if r.outbox is not None:
                r.outbox.now = t
                r.outbox.flush()
        delivery.run_until(math.inf)

    def _report_stats(self, now: float) -> None:
        """What each subscriber's stats tick sends (engine-events-and-subscriber.md §7)."""
        cfg = self.cfg
        delivery = self.delivery
        assert delivery is not None and self.index is not None
        index = self.index
        ceiling = cfg.max_concurrency_ceiling
        for r in self.replicas:
            r.liveness.probe_ok(now)  # the scrape answered: the engine is alive
            c = r.engine.counters
            hit_rate = 0.0
            if r.stats_seen:
                hit_rate = delta_hit_rate(c.hits - r.last_hits, c.queries - r.last_queries)
            r.stats_seen = True
            r.last_queries, r.last_hits = c.queries, c.hits
            upd = Update(
                replica_id=r.name,
                model_id=self.model_id,
                tenant_id=cfg.tenant_id,
                hash_scheme=cfg.hash_scheme,
                timestamp_us=_wall_us(now),
                stats=Stats(hit_rate=hit_rate, pressure=pressure(r.engine.load(), ceiling)),
            )
            delivery.at(now + cfg.transport_s, functools.partial(index.apply_update, upd))

    # -- the loop ---------------------------------------------------------------------------------

    def run(self, progress: Callable[[int], None] | None = None) -> PolicyResult:
        started = time.perf_counter()
        cfg = self.cfg
        heap: list[tuple[float, int, int, Any]] = []
        seq = 0
        it = iter(self.requests)
        offset = WARMUP_S if cfg.warmup else 0.0
        nxt = next(it, None)
        if nxt is not None:
            heapq.heappush(heap, (nxt.arrival + offset, seq, _ARRIVAL, nxt))
        if cfg.warmup:
            for i, r in enumerate(self.replicas):
                # negative keys: not a workload request (no TTFT, no gateway accounting)
                r.engine.submit(-1 - i, warmup_tokens(r.name), "", 1, 0.0)
                for adm in r.engine.schedule(0.0):
                    r.publish(adm, "", 0.0)
                    seq += 1
                    heapq.heappush(heap, (adm.finish_at, seq, _FINISH, (r, adm.key)))
        base = {r.name: (r.engine.counters.hits, r.engine.counters.queries,
                         r.engine.counters.requests) for r in self.replicas}
        res = self.result
        policies = self.policies
        n_gw = len(policies)
        inflight = [{n: 0 for n in self.names} for _ in policies]
        gateway_of: dict[int, int] = {}
        needs_hint = self.policy.needs_hint
        needs_oracle = self.policy.needs_oracle
        bs = cfg.engine.block_size
        names = self.names
        replicas = self.replicas
        by_name = self.by_name
        per_replica = {n: 0 for n in names}
        reasons = res.reasons
        ttft = res.ttft_s
        hint_s = res.hint_s
        router = self.router
        now = 0.0
        done = 0
        arrivals: dict[int, float] = {}
        windows = res.windows
        window_s = cfg.series_window_s
        stale_keys: set[int] = set()
        last_arrival = 0.0
        while heap:
            now, _s, kind, data = heapq.heappop(heap)
            self._advance(now)
            if kind == _ARRIVAL:
                req: Request = data
                nxt = next(it, None)
                if nxt is not None:
                    seq += 1
                    heapq.heappush(heap, (nxt.arrival + offset, seq, _ARRIVAL, nxt))
                tokens = req.tokens
                chain = fingerprint.chain_packed(tokens, bs)
                gw = req.index % n_gw
                policy = policies[gw]
                load = inflight[gw]
                route = RouteInput(
                    tenant_id=cfg.tenant_id,
                    model_id=self.model_id,
                    adapter_id=req.adapter,
                    tokens=tokens,
                    chain=chain,
                    block_size=bs,
                    load=dict(load),
                )
                engine_hashes: list[int] | None = None
                engine_adapter = req.engine_adapter
                stale = False
                if needs_hint and router is not None:
                    self.clock.set_now_us(_wall_us(now))
                    t0 = time.perf_counter()
                    n = len(chain) >> 3
                    result = router.lookup(
                        LookupRequest(
                            tenant_id=cfg.tenant_id,
                            model_id=self.model_id,
                            hash_scheme=cfg.hash_scheme,
                            adapter_id=req.adapter,
                            block_hashes=chain,
                            packed_hashes=True,
                            block_token_counts=[bs] * n,
                        )
                    )
                    dt = time.perf_counter() - t0
                    hint_s.append(dt)
                    scores = result.replica_scores
                    route.hint = Hint(
                        result.reason_code,
                        tuple(s.replica_id for s in scores),
                        dt,
                        tuple(s.matched_tokens for s in scores),
                    )
                    if scores and result.reason_code == "PREFIX_MATCH":
                        engine_hashes = replicas[0].engine.cache.chain(tokens, engine_adapter)
                        held = by_name[scores[0].replica_id].engine.cache.match(engine_hashes)
                        stale = scores[0].matched_tokens > held * bs
                if needs_oracle:
                    engine_hashes = replicas[0].engine.cache.chain(tokens, engine_adapter)
                    cap = min(len(engine_hashes), (len(tokens) - 1) // bs)
                    route.oracle = {
                        r.name: min(r.engine.cache.match(engine_hashes), cap) * bs
                        for r in replicas
                    }
                decision = policy.choose(route, names)
                policy.observe(route, decision.replica)
                reasons[decision.reason] = reasons.get(decision.reason, 0) + 1
                per_replica[decision.replica] += 1
                target = by_name[decision.replica]
                key = req.index
                try:
                    target.engine.submit(
                        key, tokens, engine_adapter, req.max_tokens, now, engine_hashes
                    )
                except ValueError:  # the engine answers 400 (prompt larger than its cache)
                    res.rejected += 1
                    continue
                load[decision.replica] += 1
                gateway_of[key] = gw
                arrivals[key] = now
                last_arrival = req.arrival
                if stale:
                    res.stale_hints += 1
                    stale_keys.add(key)
                admitted = target.engine.schedule(now)
            else:
                target, k = data
                if k >= 0:
                    inflight[gateway_of.pop(k)][target.name] -= 1
                target.engine.finish()
                admitted = target.engine.schedule(now)
            for adm in admitted:
                k = adm.key
                target.publish(adm, adm.adapter, now)
                seq += 1
                heapq.heappush(heap, (adm.finish_at, seq, _FINISH, (target, k)))
                if k < 0:
                    continue
                arrived = arrivals.pop(k)
                t = adm.first_token_at - arrived
                ttft.append(t)
                wi = int((arrived - offset) // window_s)
                while len(windows) <= wi:
                    windows.append(Window(len(windows) * window_s))
                w = windows[wi]
                w.requests += 1
                w.hit_tokens += adm.hit_tokens
                w.query_tokens += adm.prompt_tokens
                w.ttft_s.append(t)
                if k in stale_keys:
                    stale_keys.discard(k)
                    w.stale_hints += 1
                done += 1
                if progress is not None and not done % 1000:
                    progress(done)
        for r in replicas:
            c = r.engine.counters
            h0, q0, n0 = base[r.name]
            res.hit_tokens += c.hits - h0
            res.query_tokens += c.queries - q0
            res.requests += c.requests - n0
            res.evicted_blocks += c.evicted_blocks
        res.per_replica = per_replica
        res.workload_seconds = cfg.workload.duration or last_arrival
        res.refreshed_entries = sum(r.outbox.refreshed for r in replicas if r.outbox)
        res.adapters_forgotten = sum(r.forgotten for r in replicas)
        res.sim_seconds = now
        res.wall_seconds = time.perf_counter() - started
        if progress is not None:
            progress(done)
        return res


def simulate(cfg: SimConfig, requests: Iterable[Request] | None = None,
             progress: Callable[[int], None] | None = None) -> PolicyResult:
    """Run one configuration and return its measurements."""
    return Simulator(cfg, requests).run(progress)

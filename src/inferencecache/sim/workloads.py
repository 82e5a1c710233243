"""Seeded request streams that exercise prefix caching: chat, RAG, LoRA tenants and a mix.

Each workload is a lazy iterator of :class:`Request` in arrival order (Poisson arrivals), built
from one seed, so the simulator and the demo replay exactly the same prompts. Prompts are token
ids (``array('I')``): the demo sends them as OpenAI token-id prompts, so no tokenizer can make
the gateway's fingerprint differ from the engine's. Sizes are chosen against the default
cluster (``sim.cluster``: 8 replicas of 4096 tokens each, 128 blocks of 32) so one replica's
cache holds only a fraction of the live working set and must evict, while the replicas together
hold most of it:

* ``chat`` — multi-turn sessions; each turn's prompt is the tenant's system prompt, the whole
  history (user turns and the assistant's answers) and the new user message.
* ``rag`` — 32 long shared documents (Zipf popularity, s = 0.6), many short questions about them.
* ``lora`` — chat sessions of tenants served through their own LoRA adapter (8 adapters), all
  with the *same* 256-token system prompt: identical tokens that are still one cache entry (and
  one index partition) per adapter.
* ``mix`` — the three at once, in proportion 2:1:1.
* ``lora-churn`` — ``lora`` with adapters that come and go: each adapter stays loaded for a while
  (``ChurnShape.on_s``), is unloaded (``off_s``), then loads again as a new version (new
  weights, so the engine's blocks of the old version never match it). Sessions of an unloaded
  adapter end (its requests would be refused); :class:`AdapterSchedule` says what every engine
  serves at any time, as its ``/v1/models`` would list it.

``WorkloadSpec.duration`` > 0 generates every request arriving before it (the request count is
then ignored), for long simulated runs (``simulate --duration 2h``).
"""

from __future__ import annotations

import array
import bisect
import dataclasses
import heapq
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Final

VOCAB: Final = 65_536
"""Token ids are drawn uniformly from ``[0, VOCAB)``."""

DEFAULT_MODEL: Final = "sim-model"
WORKLOADS: Final = ("chat", "rag", "lora", "mix", "lora-churn")


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a workload."""

    index: int  # position in arrival order, from 0
    arrival: float  # seconds since the workload started
    tenant: str  # who sent it (content-level: whose system prompt, adapter, documents)
    model: str  # the OpenAI ``model`` field: the base model or a LoRA adapter name
    adapter: str  # "" for the base model, else the adapter name (== model)
    tokens: array.array[int]  # prompt token ids
    max_tokens: int  # output length
    session: str  # conversation / document the prompt belongs to
    kind: str  # chat, rag or lora
    adapter_version: int = 0  # lora-churn: which load of the adapter served it (0: static)

    @property
    def engine_adapter(self) -> str:
        """The adapter as the engine's block hashes see it: name and version (a reload from
        another path is another adapter to the engine, vLLM's hash keys include the path)."""
        return engine_adapter(self.adapter, self.adapter_version)


def engine_adapter(name: str, version: int) -> str:
    """``name`` for a static adapter (or the base model), ``name@vN`` for version ``N``."""
    return f"{name}@v{version}" if version and name else name


def served_name(engine_key: str) -> str:
    """The adapter name of an :func:`engine_adapter` key (what the engine's events carry)."""
    return engine_key.partition("@")[0]


class _Tokens:
    """Deterministic token runs: fresh ones from the stream's RNG, named ones cached by key."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self._named: dict[str, array.array[int]] = {}

    def fresh(self, n: int) -> array.array[int]:
        return _ids(self.rng, n)

    def named(self, key: str, n: int, seed: int) -> array.array[int]:
        """The same run for the same key and seed, independent of generation order."""
        got = self._named.get(key)
        if got is None:
            got = _ids(random.Random(f"{seed}:{key}"), n)
            self._named[key] = got
        return got


def _ids(rng: random.Random, n: int) -> array.array[int]:
    """``n`` uniform token ids in ``[0, VOCAB)`` from ``rng`` (two bytes each)."""
    return array.array("I", array.array("H", rng.randbytes(2 * n)))


class _Stream:
    """A sub-stream: yields (arrival, builder) with its own Poisson clock and RNG."""

    def __init__(self, kind: str, rate: float, seed: int, spec: WorkloadSpec, tag: str) -> None:
        self.kind = kind
        self.rate = rate
        self.spec = spec
        self.seed = seed
        self.rng = random.Random(f"{seed}:{tag}")
        self.tok = _Tokens(self.rng)
        self.tag = tag

    def gap(self, rate: float) -> float:
        return self.rng.expovariate(rate)


Push = Callable[[float, Callable[[], "Request | None"]], None]
Item = tuple[float, int, Callable[[], "Request | None"]]


@dataclass(frozen=True, slots=True)
class ChatShape:
    """Sizes of a chat-like stream (token counts are inclusive ranges)."""

    tenants: int = 8
    system_tokens: tuple[int, int] = (16, 64)
    shared_system: bool = False  # one system prompt for every tenant (the LoRA case)
    turns: tuple[int, int] = (4, 10)
    user_tokens: tuple[int, int] = (16, 64)
    answer_tokens: tuple[int, int] = (80, 200)
    think_s: float = 1.0  # mean think time between turns
    adapters: tuple[str, ...] = ()  # tenant i uses adapters[i % len]; () = base model


@dataclass(frozen=True, slots=True)
class RagShape:
    """Sizes of the RAG stream."""

    docs: int = 32
    doc_tokens: tuple[int, int] = (512, 1536)
    system_tokens: int = 48
    question_tokens: tuple[int, int] = (12, 48)
    answer_tokens: tuple[int, int] = (16, 80)
    zipf_s: float = 0.6


@dataclass(frozen=True, slots=True)
class ChurnShape:
    """Adapter lifetimes of ``lora-churn`` (seconds, inclusive ranges, uniform)."""

    on_s: tuple[float, float] = (120.0, 360.0)  # a version stays loaded this long
    off_s: tuple[float, float] = (30.0, 120.0)  # then nothing is loaded this long


CHAT: Final = ChatShape()
RAG: Final = RagShape()
CHURN: Final = ChurnShape()


def lora_adapters(n: int = 8) -> list[str]:
    """The adapter names of the ``lora`` workload (the engines must serve them)."""
    return [f"tenant-{chr(ord('a') + i)}-lora" for i in range(n)]


LORA: Final = ChatShape(
    tenants=8,
    system_tokens=(256, 256),
    shared_system=True,
    adapters=tuple(lora_adapters()),
)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """What to generate: workload name, request count, arrival rate, seed and base model."""

    name: str = "chat"
    requests: int = 1000
    rate: float = 40.0  # requests per second (Poisson)
    seed: int = 0
    model: str = DEFAULT_MODEL
    chat: ChatShape = field(default_factory=lambda: CHAT)
    rag: RagShape = field(default_factory=lambda: RAG)
    lora: ChatShape = field(default_factory=lambda: LORA)
    duration: float = 0.0  # > 0: every request arriving before it, whatever ``requests`` says
    churn: ChurnShape = field(default_factory=lambda: CHURN)

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"unknown workload {self.name!r} (choose from {', '.join(WORKLOADS)})")
        if self.requests < 0:
            raise ValueError("requests must not be negative")
        if not self.rate > 0 or math.isinf(self.rate):
            raise ValueError("rate must be a positive number")
        if not (self.duration >= 0 and math.isfinite(self.duration)):
            raise ValueError("duration must be a non-negative number")
        for lo, hi in (self.churn.on_s, self.churn.off_s):
            if not (0 <= lo <= hi and math.isfinite(hi)):
                raise ValueError("churn lifetimes must be ranges of non-negative seconds")
        if self.churn.on_s[1] <= 0:
            raise ValueError("churn on_s must allow a positive lifetime")


class AdapterSchedule:
    """Which version of each adapter the engines serve at any time (all engines alike).

    Static adapters (``lora``, ``mix``) are always loaded as version 0. ``lora-churn`` adapters
    alternate loaded (``on_s``) and unloaded (``off_s``) from a random phase; each load is the
    next version, from 1. Lifetimes come from one RNG per adapter, extended lazily, so any time
    can be asked in any order and the answer depends on the seed only."""

    def __init__(self, adapters: list[str], seed: int, churn: ChurnShape | None) -> None:
        self.adapters = tuple(adapters)
        self.churn = churn
        self._rngs: dict[str, random.Random] = {}
        self._lives: dict[str, list[tuple[float, float]]] = {}  # version i+1 loaded [a, b)
        if churn is not None:
            for name in self.adapters:
                rng = random.Random(f"{seed}:churn:{name}")
                start = -rng.uniform(0.0, churn.on_s[1])
                self._rngs[name] = rng
                self._lives[name] = [(start, start + max(1e-3, rng.uniform(*churn.on_s)))]

    def version(self, name: str, t: float) -> int | None:
        """The version of ``name`` loaded at ``t`` (0 for a static adapter), ``None`` when it is
        not loaded (or not an adapter of this workload)."""
        if name not in self.adapters:
            return None
        churn = self.churn
        if churn is None:
            return 0
        lives = self._lives[name]
        rng = self._rngs[name]
        while lives[-1][1] <= t:
            load = lives[-1][1] + rng.uniform(*churn.off_s)
            lives.append((load, load + max(1e-3, rng.uniform(*churn.on_s))))
        i = bisect.bisect_right(lives, (t, math.inf)) - 1
        if i >= 0 and lives[i][0] <= t < lives[i][1]:
            return i + 1
        return None

    def served(self, t: float) -> dict[str, str]:
        """What an engine's ``/v1/models`` lists at ``t``: ``{adapter: root}`` (the root, the
        adapter's path, changes with every version)."""
        out: dict[str, str] = {}
        for name in self.adapters:
            v = self.version(name, t)
            if v is not None:
                out[name] = f"/adapters/{name}" + (f"/v{v}" if v else "")
        return out


def adapter_schedule(spec: WorkloadSpec) -> AdapterSchedule:
    """The adapter lifecycle of ``spec``'s workload (no adapters: an empty schedule)."""
    churn = spec.churn if spec.name == "lora-churn" else None
    return AdapterSchedule(adapters_of(spec), spec.seed, churn)


class _ChatStream(_Stream):
    """Multi-turn sessions. Session starts are Poisson; turns follow after a think time."""

    def __init__(
        self, rate: float, seed: int, spec: WorkloadSpec, tag: str = "chat",
        shape: ChatShape = CHAT, schedule: AdapterSchedule | None = None,
    ) -> None:
        super().__init__("lora" if shape.adapters else "chat", rate, seed, spec, tag)
        self.shape = shape
        mean_turns = (shape.turns[0] + shape.turns[1]) / 2
        self.session_rate = rate / mean_turns
        self.sessions = 0
        self.schedule = schedule  # adapters that come and go (lora-churn); None: always there

    def _version(self, tenant: int, at: float) -> int | None:
        """The tenant's adapter version loaded at ``at`` (0: base model or static adapter),
        ``None`` when its adapter is not loaded (the engine would refuse the request)."""
        if self.schedule is None or not self.shape.adapters:
            return 0
        return self.schedule.version(self.shape.adapters[tenant % len(self.shape.adapters)], at)

    def system_key(self, tenant: int) -> str:
        return f"{self.tag}:system" if self.shape.shared_system else f"{self.tag}:system:{tenant}"

    def system(self, tenant: int) -> array.array[int]:
        key = self.system_key(tenant)
        n = random.Random(f"{self.seed}:{key}:len").randint(*self.shape.system_tokens)
        return self.tok.named(key, n, self.seed)

    def start(self, at: float, push: Push) -> None:
        """Schedule the next session start at ``at``."""
        push(at, lambda: self._begin(at, push))

    def _begin(self, at: float, push: Push) -> None:
        rng = self.rng
        self.sessions += 1
        sid = f"{self.tag}-{self.sessions}"
        tenant = rng.randrange(self.shape.tenants)
        turns = rng.randint(*self.shape.turns)
        version = self._version(tenant, at)
        if version is not None:
            history = array.array("I", self.system(tenant))
            self._turn(sid, tenant, turns, 1, history, at, push, version)
        self.start(at + self.gap(self.session_rate), push)

    def _turn(
        self,
        sid: str,
        tenant: int,
        turns: int,
        k: int,
        history: array.array[int],
        at: float,
        push: Push,
        version: int = 0,
    ) -> None:
        if version and self._version(tenant, at) != version:
            return  # the adapter was unloaded (or replaced) since: the session ends
        rng = self.rng
        shape = self.shape
        user = self.tok.fresh(rng.randint(*shape.user_tokens))
        answer_len = rng.randint(*shape.answer_tokens)
        prompt = history + user
        adapter = shape.adapters[tenant % len(shape.adapters)] if shape.adapters else ""
        name = f"{self.tag}-tenant-{tenant}"

        def emit() -> Request:
            return Request(
                0, at, name, adapter or self.spec.model, adapter, prompt, answer_len, sid,
                self.kind, version if adapter else 0,
            )

        push(at, emit)
        if k < turns:
            # the assistant's answer joins the history the next turn re-sends
            nxt = prompt + self.tok.fresh(answer_len)
            think = shape.think_s
            when = at + think * 0.2 + self.gap(1.0 / (think * 0.8))
            push(when, lambda: self._turn(sid, tenant, turns, k + 1, nxt, when, push, version))


class _RagStream(_Stream):
    """Questions over a few long documents (Zipf popularity) behind one short system prompt."""

    def __init__(
        self, rate: float, seed: int, spec: WorkloadSpec, tag: str = "rag", shape: RagShape = RAG
    ) -> None:
        super().__init__("rag", rate, seed, spec, tag)
        self.shape = shape
        weights = [1.0 / (i + 1) ** shape.zipf_s for i in range(shape.docs)]
        total = sum(weights)
        self.cum: list[float] = []
        acc = 0.0
        for w in weights:
            acc += w / total
            self.cum.append(acc)
        # popularity rank -> document id, shuffled so doc ids carry no rank information
        self.order = list(range(shape.docs))
        random.Random(f"{seed}:{tag}:order").shuffle(self.order)
        self.system = self.tok.named(f"{tag}:system", shape.system_tokens, seed)

    def doc(self, d: int) -> array.array[int]:
        n = random.Random(f"{self.seed}:{self.tag}:doc:{d}:len").randint(*self.shape.doc_tokens)
        return self.tok.named(f"{self.tag}:doc:{d}", n, self.seed)

    def start(self, at: float, push: Push) -> None:
        push(at, lambda: self._ask(at, push))

    def _ask(self, at: float, push: Push) -> None:
        rng = self.rng
        u = rng.random()
        shape = self.shape
        rank = bisect.bisect_left(self.cum, u)
        d = self.order[min(rank, shape.docs - 1)]
        prompt = self.system + self.doc(d) + self.tok.fresh(rng.randint(*shape.question_tokens))
        out = rng.randint(*shape.answer_tokens)
        tenant = f"{self.tag}-tenant-{d % 4}"
        model = self.spec.model
        push(at, lambda: Request(0, at, tenant, model, "", prompt, out, f"doc-{d}", "rag"))
        self.start(at + self.gap(self.rate), push)


def generate(spec: WorkloadSpec) -> Iterator[Request]:
    """The workload's requests in arrival order, ``spec.requests`` of them."""
    heap: list[Item] = []
    counter = 0

    def push(at: float, fn: Callable[[], Request | None]) -> None:
        nonlocal counter
        counter += 1
        heapq.heappush(heap, (at, counter, fn))

    seed = spec.seed
    rate = spec.rate
    chat, rag, lora = spec.chat, spec.rag, spec.lora
    if spec.name == "chat":
        _ChatStream(rate, seed, spec, "chat", chat).start(0.0, push)
    elif spec.name == "rag":
        _RagStream(rate, seed, spec, "rag", rag).start(0.0, push)
    elif spec.name == "lora":
        _ChatStream(rate, seed, spec, "lora", lora).start(0.0, push)
    elif spec.name == "lora-churn":
        _ChatStream(rate, seed, spec, "lora", lora, adapter_schedule(spec)).start(0.0, push)
    else:
        _ChatStream(rate * 0.5, seed, spec, "chat", chat).start(0.0, push)
        _RagStream(rate * 0.25, seed, spec, "rag", rag).start(0.0, push)
        _ChatStream(rate * 0.25, seed, spec, "lora", lora).start(0.0, push)
    emitted = 0
    limit = spec.requests if spec.duration <= 0 else math.inf
    while heap and emitted < limit:
        at, _n, fn = heapq.heappop(heap)
        if spec.duration > 0 and at >= spec.duration:
            break
        req = fn()
        if req is None:
            continue
        yield dataclasses.replace(req, index=emitted)
        emitted += 1


def adapters_of(spec: WorkloadSpec) -> list[str]:
    """LoRA adapters a workload uses (engines must be started with them)."""
    return list(spec.lora.adapters) if spec.name in ("lora", "mix", "lora-churn") else []

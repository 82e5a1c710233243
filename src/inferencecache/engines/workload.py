"""What a fake engine publishes: the origin's fixed batch, a seeded random workload, or a script.

* **fixed** (the Go reference's ``kvevent-fake-engine``): one batch of ``--events`` chained
  BlockStored events covering ``--num-blocks`` blocks, engine hashes ``0xE000+i``, ts 0, no
  adapter, re-sent every ``--interval`` with seq + 1 so a late joiner never sees a suffix without
  its parent; the expected fingerprints are logged as ``EXPECT`` lines.
* **random**: requests that share prefixes from a prompt pool and add fresh blocks, an LRU
  capacity that evicts, optional periodic cache resets and LoRA adapters, all from one seed.
* **script**: JSON lines (a file or ``-`` for stdin), one batch per line, so a test can drive the
  engine step by step (see ``docs/fake-engine.md``).
"""

from __future__ import annotations

import array
import asyncio
import base64
import json
import logging
import random
import sys
from typing import Any

from inferencecache.engines.engine import FakeEngine
from inferencecache.fingerprint import prefix_hashes
from inferencecache.kvevents.encode import WireStored
from inferencecache.supervise import describe

log = logging.getLogger("inferencecache.engines")

FIXED_HASH_BASE = 0xE000


def fixed_batch_events(
    num_blocks: int, events: int, block_size: int, start_token: int, omit_token_ids: bool
) -> list[WireStored]:
    """The origin's single batch: ``events`` chained stores covering ``num_blocks`` blocks."""
    per, extra = divmod(num_blocks, events)
    out: list[WireStored] = []
    block = 0
    parent: int | None = None
    for e in range(events):
        n = per + (1 if e < extra else 0)
        hashes: list[int | bytes] = [FIXED_HASH_BASE + block + i for i in range(n)]
        first_token = start_token + block * block_size
        tokens = list(range(first_token, first_token + n * block_size))
        out.append(
            WireStored(
                hashes,
                parent,
                None if omit_token_ids else tokens,
                block_size,
                medium="GPU",
                extra_keys=[None] * n,
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            )
        )
        parent = FIXED_HASH_BASE + block + n - 1
        block += n
    return out


def expect_lines(num_blocks: int, block_size: int, start_token: int, omit: bool) -> list[str]:
    """The ``EXPECT`` lines: what a subscriber must derive from the fixed batch."""
    if omit:
        return ["EXPECT no index entries (token_ids omitted: the subscriber warns and skips)"]
    tokens = list(range(start_token, start_token + num_blocks * block_size))
    return [
        f"EXPECT prefix_hash[{i}]={h:016x} token_count={(i + 1) * block_size}"
        for i, h in enumerate(prefix_hashes(tokens, block_size))
    ]


async def run_fixed(
    engine: FakeEngine,
    *,
    num_blocks: int,
    events: int,
    start_token: int,
    interval: float,
    omit_token_ids: bool,
) -> None:
    """Re-send the fixed batch every ``interval`` forever."""
    for line in expect_lines(num_blocks, engine.block_size, start_token, omit_token_ids):
        log.info(line)
    batch = fixed_batch_events(num_blocks, events, engine.block_size, start_token, omit_token_ids)
    while True:
        for ev in batch:
            engine.publisher.add(ev)
        engine.end_step(ts=0.0)
        await asyncio.sleep(interval)


class RandomWorkload:
    """Seeded requests over a prompt pool; every request adds ``new_blocks`` fresh blocks."""

    def __init__(
        self,
        engine: FakeEngine,
        *,
        seed: int,
        prompt_pool: int = 16,
        prefix_blocks: int = 4,
        new_blocks: int = 4,
        requests_per_step: int = 1,
        clear_every: int = 0,
        adapters: dict[int, str] | None = None,
        lora_fraction: float = 0.0,
        write_lora_name: bool = True,
    ) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        bs = engine.block_size
        self.pool = [self._tokens(self.rng.randint(0, prefix_blocks) * bs) for _ in
                     range(max(1, prompt_pool))]
        self.new_blocks = max(1, new_blocks)
        self.requests_per_step = max(1, requests_per_step)
        self.clear_every = clear_every
        self.adapters = sorted((adapters or {}).items())
        self.lora_fraction = lora_fraction
        self.write_lora_name = write_lora_name
        self.steps_done = 0
        self.blocks_stored = 0

    def _tokens(self, n: int) -> list[int]:
        return list(array.array("H", self.rng.randbytes(2 * n)))

    def step(self) -> int | None:
        """Queue and publish one step; returns its seq."""
        self._queue_step()
        return self.engine.end_step()

    def _queue_step(self) -> None:
        engine = self.engine
        self.steps_done += 1
        if self.clear_every and self.steps_done % self.clear_every == 0:
            engine.reset_prefix_cache()
        for _ in range(self.requests_per_step):
            tokens = self.rng.choice(self.pool) + self._tokens(
                self.rng.randint(1, self.new_blocks) * engine.block_size
            )
            lora_id: int | None = None
            lora_name: str | None = None
            if self.adapters and self.rng.random() < self.lora_fraction:
                lora_id, name = self.rng.choice(self.adapters)
                lora_name = name if self.write_lora_name else None
            result = engine.serve(tokens, lora_id=lora_id, lora_name=lora_name)
            self.blocks_stored += len(result.stored)

    async def run(self, steps: int, interval: float, rate: float = 0.0,
                  precompute: bool = False) -> None:
        """``steps`` steps (0 = forever), ``interval`` apart, or paced to ``rate`` blocks/s.

        ``precompute`` (needs ``steps``) encodes every batch first and then only publishes, so
        a benchmark measures the consumers rather than this generator.
        """
        loop = asyncio.get_running_loop()
        payloads: list[tuple[bytes, int]] = []
        if precompute and steps:
            for _ in range(steps):
                self._queue_step()
                payload = self.engine.encode_step()
                if payload is not None:
                    payloads.append((payload, self.blocks_stored))
            log.info("workload precomputed", extra={"batches": len(payloads),
                                                     "blocks": self.blocks_stored})
        started = loop.time()
        log.info("workload publishing")
        i = 0
        while True:
            if payloads:
                if i == len(payloads):
                    break
                payload, stored = payloads[i]
                self.engine.publisher.publish_payload(payload)
                i += 1
            else:
                if steps and self.steps_done >= steps:
                    break
                self.step()
                stored = self.blocks_stored
            if rate > 0:
                due = started + stored / rate
                await asyncio.sleep(max(0.0, due - loop.time()))
            else:
                await asyncio.sleep(interval)
        log.info(
            "workload done",
            extra={
                "steps": self.steps_done,
                "blocks_stored": self.blocks_stored,
                "batches": engine_batches(self.engine),
                "last_seq": self.engine.publisher.next_seq - 1,
                "elapsed_s": round(loop.time() - started, 3),
            },
        )


def engine_batches(engine: FakeEngine) -> int:
    return engine.publisher.batches_published


MAX_SCRIPT_LINE = 16 * 1024 * 1024
"""Longest stdin script line read whole (longer ones are skipped with a warning)."""


class ScriptError(ValueError):
    pass


def _ops(line: Any) -> tuple[list[dict[str, Any]], bool]:
    if isinstance(line, list):
        return line, True
    if isinstance(line, dict) and "ops" in line:
        return list(line["ops"]), bool(line.get("live", True))
    if isinstance(line, dict):
        return [line], bool(line.get("live", True))
    raise ScriptError(f"a script line must be an object or a list, got {type(line).__name__}")


async def run_script_line(engine: FakeEngine, text: str) -> bool:
    """Apply one script line; ``False`` when the script asked the engine to exit."""
    text = text.strip()
    if not text or text.startswith("#"):
        return True
    ops, live = _ops(json.loads(text))
    raw: list[bytes] = []
    for op in ops:
        kind = op.get("op")
        lora = {"lora_id": op.get("lora_id"), "lora_name": op.get("lora_name")}
        medium = op.get("medium", "GPU")
        if kind == "store":
            engine.serve(list(op["tokens"]), medium=medium, **lora)
        elif kind == "remove":
            engine.evict(list(op["tokens"]), medium=medium, **lora)
        elif kind == "clear":
            engine.reset_prefix_cache()
        elif kind == "metrics":
            m = engine.metrics
            if "running" in op:
                m.running.set(op["running"])
            if "waiting" in op:
                m.waiting.set(op["waiting"])
            if "kv_cache_usage" in op:
                m.kv_cache_usage.set(op["kv_cache_usage"])
        elif kind == "raw":
            raw.append(base64.b64decode(op["payload_b64"]))
        elif kind == "sleep":
            await asyncio.sleep(float(op.get("seconds", 0)))
        elif kind == "exit":
            return False
        else:
            raise ScriptError(f"unknown script op {kind!r}")
    seq = engine.publisher.end_step(live=live) if engine.publisher.step_events else None
    seqs = [seq] if seq is not None else []
    seqs += [engine.publisher.publish_payload(p, live=live) for p in raw]
    engine.metrics.kv_cache_usage.set(engine.cache.usage())
    log.info("script step", extra={"seqs": seqs, "live": live, "blocks": len(engine.cache)})
    return True


async def run_script(engine: FakeEngine, source: str) -> bool:
    """Run a script file, or stdin for ``-`` (line by line, as lines arrive); ``True`` when the
    script ended with an ``exit`` op."""
    if source != "-":
        with open(source, encoding="utf-8") as f:
            for line in f:
                if not await run_script_line(engine, line):
                    return True
        log.info("script done")
        return False
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=MAX_SCRIPT_LINE)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while True:
        try:
            data = await reader.readline()
        except ValueError as e:  # a line over MAX_SCRIPT_LINE: dropped by the reader
            log.warning("bad script line; skipped", extra={"err": describe(e)})
            continue
        if not data:
            break
        try:
            keep_going = await run_script_line(engine, data.decode())
        except Exception as e:  # any line, however malformed: skip it, read the next
            log.warning("bad script line; skipped", extra={"err": describe(e)})
            continue
        if not keep_going:
            return True
    log.info("script done")
    return False

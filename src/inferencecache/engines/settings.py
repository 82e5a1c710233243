"""Settings of ``inferencecache fake-engine`` (engine-events-and-subscriber.md §11)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import click

from inferencecache.config import (
    DURATION,
    GO_BOOL,
    GO_INT,
    ZMQ_ENDPOINT,
    log_level_setting,
    parse_host_port,
    setting,
)
from inferencecache.engines.simulated import (
    DEFAULT_DECODE_MS_PER_TOKEN,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_PREFILL_BASE_MS,
    DEFAULT_PREFILL_MS_PER_TOKEN,
)
from inferencecache.kvevents.encode import DEFAULT_FORMAT, FORMATS
from inferencecache.subscriber.lora import parse_adapter_names

MODES: Final = ("fixed", "random", "script", "simulated")
"""What ``--mode`` selects: the event source (``--workload`` is demo/simulate's traffic mix)."""
MAX_FIXED_TOKENS: Final = 1 << 24


@dataclass(frozen=True)
class FakeEngineSettings:
    """Flags of ``inferencecache fake-engine``."""

    bind: str = setting(
        "tcp://127.0.0.1:5557", param=ZMQ_ENDPOINT, help="PUB endpoint to bind (port 0: any)."
    )
    topic: str = setting("", help="Topic frame of every message.")
    block_size: int = setting(16, param=GO_INT, help="Tokens per block.")
    wire_format: str = setting(
        DEFAULT_FORMAT, help=f"Engine release whose wire shape to write: {', '.join(FORMATS)}."
    )
    mode: str = setting(
        "fixed",
        help="What the engine does: fixed (the origin's batch), random, script, or simulated (an "
        "OpenAI-compatible engine over an LRU block cache, docs/demo.md).",
    )
    num_blocks: int = setting(1, param=GO_INT, help="fixed: blocks in the batch.")
    events: int = setting(1, param=GO_INT, help="fixed: chained BlockStored events.")
    start_token: int = setting(0, param=GO_INT, help="fixed: first token id.")
    interval: float = setting(0.5, param=DURATION, help="fixed/random: time between batches.")
    omit_token_ids: bool = setting(False, param=GO_BOOL, help="fixed: send nil token_ids.")
    script: str = setting("", help='script: JSON-lines file, or "-" for stdin.')
    seed: int = setting(0, param=GO_INT, help="random: seed.")
    steps: int = setting(0, param=GO_INT, help="random: steps to run (0 = forever).")
    requests_per_step: int = setting(1, param=GO_INT, help="random: requests per batch.")
    prompt_pool: int = setting(16, param=GO_INT, help="random: shared prompt prefixes.")
    prefix_blocks: int = setting(4, param=GO_INT, help="random: max blocks of a shared prefix.")
    new_blocks: int = setting(4, param=GO_INT, help="random: max fresh blocks per request.")
    gpu_blocks: int = setting(
        0, param=GO_INT, help="random/script/simulated: cache capacity in blocks (0 = no limit)."
    )
    clear_every: int = setting(0, param=GO_INT, help="random: reset the cache every N steps.")
    lora_adapters: str = setting(
        "", help='random: adapters "id=name,..." to use (simulated: the adapters served).'
    )
    lora_fraction: float = setting(0.0, help="random: share of requests under an adapter.")
    rate: float = setting(0.0, help="random: target new blocks per second (0 = use --interval).")
    precompute: bool = setting(
        False, param=GO_BOOL, help="random: encode every batch first, then only publish."
    )
    wait_for_subscriber: bool = setting(
        False, param=GO_BOOL, help="Start publishing only once a subscriber is listening."
    )
    start_delay: float = setting(
        0.0, param=DURATION, help="Wait this long after binding before publishing starts."
    )
    replay_endpoint: str = setting("", param=ZMQ_ENDPOINT, help="Replay ROUTER endpoint to bind.")
    buffer_steps: int = setting(10000, param=GO_INT, help="Batches kept for replay.")
    http_address: str = setting(
        "127.0.0.1:8000", help='host:port of the vLLM-named /metrics page ("" disables).'
    )
    model_name: str = setting(
        "fake-model", help="model_name label of the metrics (simulated: the served model)."
    )
    data_parallel_rank: int = setting(0, param=GO_INT, help="Rank written in the envelope.")
    # --mode simulated (engines/openai.py, docs/demo.md)
    max_num_seqs: int = setting(
        DEFAULT_MAX_NUM_SEQS, param=GO_INT, help="simulated: concurrent sequences."
    )
    prefill_ms_per_token: float = setting(
        DEFAULT_PREFILL_MS_PER_TOKEN, help="simulated: prefill time per uncached prompt token (ms)."
    )
    prefill_base_ms: float = setting(
        DEFAULT_PREFILL_BASE_MS, help="simulated: fixed cost of each prefill (ms)."
    )
    decode_ms_per_token: float = setting(
        DEFAULT_DECODE_MS_PER_TOKEN,
        help="simulated: decode time per output token after the first (ms).",
    )
    tokenizer_dir: str = setting(
        "", help="simulated: <model>/tokenizer.json directory for text prompts (as the gateway's)."
    )
    kv_role: str = setting(
        "both",
        param=click.Choice(["prefill", "decode", "both"]),
        help="simulated: disaggregated prefill/decode role, as vLLM's kv_role (kv_producer, "
        "kv_consumer, kv_both): requests carry NIXL-style kv_transfer_params (docs/gateway.md).",
    )
    log_level: str = log_level_setting()

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"--block-size: must be >= 1, got {self.block_size}")
        if self.wire_format not in FORMATS:
            raise ValueError(
                f"--wire-format: unknown {self.wire_format!r} (choose from {', '.join(FORMATS)})"
            )
        if self.mode not in MODES:
            raise ValueError(f"--mode: want fixed, random, script or simulated, got {self.mode!r}")
        if self.mode == "simulated":
            if not self.http_address:
                raise ValueError("--http-address: required with --mode simulated")
            if self.max_num_seqs < 1:
                raise ValueError(f"--max-num-seqs: must be >= 1, got {self.max_num_seqs}")
            for name in ("prefill_ms_per_token", "prefill_base_ms", "decode_ms_per_token"):
                value = getattr(self, name)
                if not 0 <= value < float("inf"):
                    raise ValueError(f"--{name.replace('_', '-')}: must be >= 0, got {value}")
        if self.mode == "fixed":
            if self.num_blocks < 1:
                raise ValueError(f"--num-blocks: must be >= 1, got {self.num_blocks}")
            if not 1 <= self.events <= self.num_blocks:
                raise ValueError(f"--events: must be in 1..--num-blocks, got {self.events}")
            if self.start_token < 0:
                raise ValueError(f"--start-token: must be >= 0, got {self.start_token}")
            total = self.num_blocks * self.block_size
            if total > MAX_FIXED_TOKENS:
                raise ValueError(f"--num-blocks x --block-size: {total} tokens > 2^24")
            if self.start_token + total - 1 > 0xFFFFFFFF:
                raise ValueError("--start-token: token ids would exceed uint32")
            if self.interval <= 0:
                raise ValueError("--interval: must be positive")
        elif self.interval < 0:
            raise ValueError("--interval: must not be negative")
        if self.mode == "script" and not self.script:
            raise ValueError("--script: required with --mode script")
        for name in ("steps", "gpu_blocks", "clear_every", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')}: must not be negative")
        for name in ("requests_per_step", "prompt_pool", "new_blocks", "buffer_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be >= 1")
        if self.prefix_blocks < 0:
            raise ValueError("--prefix-blocks: must not be negative")
        if not 0.0 <= self.lora_fraction <= 1.0:
            raise ValueError("--lora-fraction: must be in [0, 1]")
        if self.precompute and (self.mode != "random" or not self.steps):
            raise ValueError("--precompute: needs --mode random and --steps > 0")
        if self.start_delay < 0:
            raise ValueError("--start-delay: must not be negative")
        if self.rate < 0:
            raise ValueError("--rate: must not be negative")
        try:
            parse_adapter_names(self.lora_adapters)
        except ValueError as e:
            raise ValueError(f"--lora-adapters: {e}") from None
        if self.http_address:
            try:
                parse_host_port(self.http_address)
            except ValueError as e:
                raise ValueError(f"--http-address: {e}") from None

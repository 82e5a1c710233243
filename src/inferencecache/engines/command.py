"""``inferencecache fake-engine``: a test engine that speaks the real KV-event wire format.

Start-up problems (bad flags, an unreadable ``--script``, a bad ``--tokenizer-dir``, an endpoint
or address that cannot be bound) exit 2 with one line on stderr naming the flag, before anything
is published.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING

import click
import zmq.asyncio

from inferencecache import logs
from inferencecache.config import CONTEXT, command_options, parse_host_port
from inferencecache.engines.cache import BlockCache
from inferencecache.engines.engine import FakeEngine
from inferencecache.engines.metrics import EngineMetrics, MetricsPage
from inferencecache.engines.publisher import BindError, EventPublisher
from inferencecache.engines.settings import FakeEngineSettings
from inferencecache.engines.workload import RandomWorkload, run_fixed, run_script
from inferencecache.kvevents.encode import wire_format
from inferencecache.subscriber.lora import parse_adapter_names
from inferencecache.web import ListenError, bind_tcp

if TYPE_CHECKING:
    from inferencecache.tokenize.openai import EngineTokenizer

log = logging.getLogger("inferencecache.engines")


BIND_FLAGS = {"endpoint": "--bind", "replay_endpoint": "--replay-endpoint"}


def _bind_error(e: BindError) -> click.UsageError:
    return click.UsageError(f"cannot bind {BIND_FLAGS[e.which]} {e.endpoint}: {e.reason}")


async def _publish(engine: FakeEngine, s: FakeEngineSettings) -> bool:
    """Publish what ``--mode`` asks for; ``True`` when the engine should exit afterwards."""
    if s.wait_for_subscriber:
        topic = await engine.publisher.wait_for_subscriber()
        log.info("subscriber joined", extra={"topic": topic.decode(errors="replace")})
    if s.start_delay > 0:
        await asyncio.sleep(s.start_delay)
    log.info("workload starting", extra={"mode": s.mode})
    if s.mode == "fixed":
        await run_fixed(
            engine,
            num_blocks=s.num_blocks,
            events=s.events,
            start_token=s.start_token,
            interval=s.interval,
            omit_token_ids=s.omit_token_ids,
        )
        return False
    if s.mode == "script":
        return await run_script(engine, s.script)
    fmt = wire_format(s.wire_format)
    work = RandomWorkload(
        engine,
        seed=s.seed,
        prompt_pool=s.prompt_pool,
        prefix_blocks=s.prefix_blocks,
        new_blocks=s.new_blocks,
        requests_per_step=s.requests_per_step,
        clear_every=s.clear_every,
        adapters=parse_adapter_names(s.lora_adapters),
        lora_fraction=s.lora_fraction,
        write_lora_name="lora_name" in fmt.stored_fields,
    )
    await work.run(s.steps, s.interval, s.rate, precompute=s.precompute)
    return False


async def _main(
    s: FakeEngineSettings,
    http_sock: socket.socket | None,
    tokenizers: Mapping[str, EngineTokenizer],
) -> int:
    if s.mode == "simulated":
        from inferencecache.engines.openai import serve

        assert http_sock is not None  # --mode simulated requires --http-address
        try:
            return await serve(s, http_sock, tokenizers)
        except BindError as e:
            raise _bind_error(e) from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    ctx = zmq.asyncio.Context()
    publisher = EventPublisher.from_settings(ctx, s, see_subscribers=s.wait_for_subscriber)
    metrics = EngineMetrics(s.model_name, block_size=s.block_size)
    page = MetricsPage(metrics)
    try:
        publisher.start()
        http = ""
        if http_sock is not None:
            port = await page.start_socket(http_sock)
            http = f"{parse_host_port(s.http_address).host}:{port}"
    except BaseException as e:
        await publisher.close()
        ctx.destroy(linger=0)
        if isinstance(e, BindError):
            raise _bind_error(e) from None
        raise
    engine = FakeEngine(publisher, BlockCache(s.block_size, s.gpu_blocks), metrics)
    log.info(
        "fake engine ready",
        extra={
            "endpoint": publisher.endpoint,
            "replay_endpoint": publisher.replay_endpoint,
            "http_address": http,
            "topic": s.topic,
            "wire_format": s.wire_format,
            "block_size": s.block_size,
            "mode": s.mode,
        },
    )
    work = asyncio.create_task(_publish(engine, s))
    waiter = asyncio.create_task(stop.wait())
    await asyncio.wait({work, waiter}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if work.done() and not work.cancelled():
        exc = work.exception()
        if exc is not None:
            log.error("workload failed", extra={"err": repr(exc)})
            code = 1
        elif not work.result():
            await waiter  # keep serving replay and metrics until told to stop
    for task in (work, waiter):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    await page.stop()
    await publisher.close()
    ctx.destroy(linger=0)
    log.info("fake engine stopped", extra={"batches": publisher.batches_published})
    return code


@click.command("fake-engine", context_settings=CONTEXT)
@command_options(FakeEngineSettings)
def fake_engine(settings: FakeEngineSettings) -> int:
    """Publish vLLM/SGLang-shaped KV-cache events on ZeroMQ (and vLLM metrics over HTTP)."""
    logs.setup(settings.log_level)
    s = settings
    if s.mode == "script" and s.script != "-":
        try:
            with open(s.script, "rb"):
                pass
        except OSError as e:
            raise click.UsageError(
                f"cannot read --script {s.script!r}: {e.strerror or e}"
            ) from None
    tokenizers: dict[str, EngineTokenizer] = {}
    if s.mode == "simulated" and s.tokenizer_dir:
        from inferencecache.tokenize import TokenizerLoadError
        from inferencecache.tokenize.openai import load_engine_tokenizers

        try:
            tokenizers = load_engine_tokenizers(s.tokenizer_dir)
        except TokenizerLoadError as e:
            raise click.UsageError(f"--tokenizer-dir: {e}") from None
    http_sock = None
    if s.http_address:
        try:
            http_sock = bind_tcp("--http-address", parse_host_port(s.http_address))
        except ListenError as e:
            raise click.UsageError(str(e)) from None
    try:
        return asyncio.run(_main(s, http_sock, tokenizers))
    finally:
        if http_sock is not None:
            http_sock.close()

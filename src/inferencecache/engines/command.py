"""``inferencecache fake-engine``: a test engine that speaks the real KV-event wire format."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import click
import zmq.asyncio

from inferencecache import logs
from inferencecache.config import command_options, parse_host_port
from inferencecache.engines.cache import BlockCache
from inferencecache.engines.engine import FakeEngine
from inferencecache.engines.metrics import EngineMetrics, MetricsPage
from inferencecache.engines.publisher import EventPublisher
from inferencecache.engines.settings import FakeEngineSettings
from inferencecache.engines.workload import RandomWorkload, run_fixed, run_script
from inferencecache.kvevents.encode import wire_format
from inferencecache.subscriber.lora import parse_adapter_names

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}

log = logging.getLogger("inferencecache.engines")


async def _workload(engine: FakeEngine, s: FakeEngineSettings) -> bool:
    """Run the chosen workload; ``True`` when the engine should exit afterwards."""
    if s.wait_for_subscriber:
        topic = await engine.publisher.wait_for_subscriber()
        log.info("subscriber joined", extra={"topic": topic.decode(errors="replace")})
    if s.start_delay > 0:
        await asyncio.sleep(s.start_delay)
    log.info("workload starting", extra={"workload": s.workload})
    if s.workload == "fixed":
        await run_fixed(
            engine,
            num_blocks=s.num_blocks,
            events=s.events,
            start_token=s.start_token,
            interval=s.interval,
            omit_token_ids=s.omit_token_ids,
        )
        return False
    if s.workload == "script":
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


async def _main(s: FakeEngineSettings) -> int:
    if s.workload == "simulated":
        from inferencecache.engines.openai import serve

        return await serve(s)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    ctx = zmq.asyncio.Context()
    publisher = EventPublisher.from_settings(ctx, s, see_subscribers=s.wait_for_subscriber)
    metrics = EngineMetrics(s.model_name)
    page = MetricsPage(metrics)
    try:
        publisher.start()
        http = ""
        if s.http_address:
            addr = parse_host_port(s.http_address)
            port = await page.start(addr.host, addr.port)
            http = f"{addr.host}:{port}"
    except (zmq.ZMQError, OSError) as e:
        log.error("fake engine failed to start", extra={"err": str(e)})
        await publisher.close()
        ctx.destroy(linger=0)
        return 1
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
            "workload": s.workload,
        },
    )
    work = asyncio.create_task(_workload(engine, s))
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
    logs.setup()
    return asyncio.run(_main(settings))

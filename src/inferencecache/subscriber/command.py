"""``inferencecache subscribe``: the engine-side sidecar (subscriber spec §8)."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from typing import Final

import click

from inferencecache import logs
from inferencecache.config import command_options
from inferencecache.subscriber.settings import SubscribeSettings

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}

log = logging.getLogger("inferencecache.subscriber")

# The reverse map holds a tuple per engine block (hundreds of thousands, long-lived); with the
# default gen-0 threshold (700) a burst of stores triggers collections that walk them over and
# over (~30 % of the subscriber's CPU under load). A larger threshold keeps the same bound on
# garbage while collecting ~14x less often.
GC_THRESHOLD: Final = (10_000, 10, 10)


async def _main(settings: SubscribeSettings) -> int:
    from inferencecache.subscriber.app import Subscriber

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    sub = Subscriber(settings)
    try:
        await sub.run(stop)
    except OSError as e:  # e.g. the metrics address is taken
        log.error("kvevent-subscriber failed to start", extra={"err": str(e)})
        return 1
    return 0


@click.command("subscribe", context_settings=CONTEXT)
@command_options(SubscribeSettings)
def subscribe(settings: SubscribeSettings) -> int:
    """Follow one engine's KV-cache events (ZeroMQ) and report them to the server (gRPC)."""
    logs.setup()
    gc.set_threshold(*GC_THRESHOLD)
    return asyncio.run(_main(settings))

"""``inferencecache subscribe``: the engine-side sidecar (engine-events-and-subscriber.md §8).

Start-up problems (bad flags, a ``--metrics-address`` that cannot be bound) exit 2 with one line
on stderr naming the problem, before anything is logged.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
from typing import Final

import click

from inferencecache import logs
from inferencecache.channels import security_of
from inferencecache.config import CONTEXT, command_options
from inferencecache.subscriber.settings import SubscribeSettings
from inferencecache.web import ListenError, bind_tcp

log = logging.getLogger("inferencecache.subscriber")

# The reverse map holds a tuple per engine block (hundreds of thousands, long-lived); with the
# default gen-0 threshold (700) a burst of stores triggers collections that walk them over and
# over (~30 % of the subscriber's CPU under load). A larger threshold keeps the same bound on
# garbage while collecting ~14x less often.
GC_THRESHOLD: Final = (10_000, 10, 10)


async def _main(settings: SubscribeSettings, metrics_sock: socket.socket) -> int:
    from inferencecache.metrics import publish_info
    from inferencecache.subscriber.app import Subscriber

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    sub = Subscriber(settings, metrics_sock=metrics_sock)
    publish_info(
        sub.metrics.registry,
        "inferencecache_subscriber",
        "Version and the settings that must agree with the engine and server (value 1).",
        {
            "replica_id": settings.replica_id,
            "model_id": settings.model_id,
            "replica_role": settings.replica_role,
            "tenant_id": settings.tenant_id,
            "hash_scheme": settings.hash_scheme,
            "block_size": settings.block_size,
            "lora_adapter_names": ",".join(
                f"{k}={v}" for k, v in sorted(settings.adapter_names.items())
            ),
            "trust_lora_name": str(settings.trust_lora_name).lower(),
        },
    )
    try:
        await sub.run(stop)
    except OSError as e:
        log.error("kvevent-subscriber failed to start", extra={"err": str(e)})
        return 1
    return 0


@click.command("subscribe", context_settings=CONTEXT)
@command_options(SubscribeSettings)
def subscribe(settings: SubscribeSettings) -> int:
    """Follow one engine's KV-cache events (ZeroMQ) and report them to the server (gRPC)."""
    logs.setup(settings.log_level)
    security_of(settings)  # the credential and TLS files, read once: exit 2 when unusable
    try:
        metrics_sock = bind_tcp("--metrics-address", settings.metrics_address)
    except ListenError as e:
        raise click.UsageError(str(e)) from None
    gc.set_threshold(*GC_THRESHOLD)
    try:
        return asyncio.run(_main(settings, metrics_sock))
    finally:
        metrics_sock.close()

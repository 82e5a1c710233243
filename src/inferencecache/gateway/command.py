"""``inferencecache gateway``: the reference gateway until SIGTERM/SIGINT.

Start-up problems (bad flags, an unreadable tokenizer directory, an address that cannot be
bound) exit 2 with one line on stderr naming the problem.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from dataclasses import replace
from typing import TYPE_CHECKING

import click

from inferencecache import logs
from inferencecache.channels import security_of
from inferencecache.config import CONTEXT, command_options
from inferencecache.gateway.settings import GatewaySettings

if TYPE_CHECKING:
    from inferencecache.tokenize.openai import EngineTokenizer

log = logging.getLogger("inferencecache.gateway")


@click.command("gateway", context_settings=CONTEXT)
@command_options(GatewaySettings)
def gateway(settings: GatewaySettings) -> int:
    """OpenAI-compatible proxy that routes each request to the engine holding its prefix."""
    logs.setup(settings.log_level)
    security_of(settings)  # the credential and TLS files, read once: exit 2 when unusable
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    import prometheus_client

    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
    from inferencecache.tokenize import TokenizerLoadError
    from inferencecache.tokenize.openai import load_engine_tokenizers
    from inferencecache.web import ListenError, bind_tcp

    tokenizers: dict[str, EngineTokenizer] = {}
    if settings.tokenizer_dir:
        try:
            tokenizers = load_engine_tokenizers(settings.tokenizer_dir)
        except TokenizerLoadError as e:
            raise click.UsageError(f"--tokenizer-dir: {e}") from e
        log.info("tokenizers loaded", extra={"models": sorted(tokenizers)})
    try:
        sock = bind_tcp("--http-address", settings.http_address)
    except ListenError as e:
        raise click.UsageError(str(e)) from e
    try:
        import uvloop  # the cheaper event loop: aiohttp and grpc.aio both run on it

        uvloop.run(_run(settings, tokenizers, sock))
    finally:
        sock.close()
    return 0


async def _run(
    settings: GatewaySettings, toks: dict[str, EngineTokenizer], sock: socket.socket
) -> None:
    from inferencecache.gateway.app import Gateway
    from inferencecache.metrics import publish_info

    gw = Gateway(settings, tokenizers=toks)
    publish_info(
        gw.metrics.registry,
        "inferencecache_gateway",
        "Version and the settings that must agree with the subscribers (value 1).",
        {
            "block_size": settings.block_size,
            "hash_scheme": settings.hash_scheme,
            "routing_policy": gw.policy.name,
        },
    )
    stop = asyncio.Event()
    received: list[str] = []
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        received.append(sig.name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await gw.start(sock)
        log.info(
            "serving",
            extra={
                "http_address": str(replace(settings.http_address, port=gw.port)),
                "server": str(settings.server),
                "routing_policy": gw.policy.name,
                "routing_params": settings.effective_policy_params,
                "engines": {rid: e.base_url for rid, e in gw.pool.engines.items()},
                "healthy": gw.pool.healthy_ids(),
                "block_size": settings.block_size,
                "tokenizers": sorted(toks),
            },
        )
        await stop.wait()
        log.info("shutting down", extra={"signal": received[0] if received else ""})
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await gw.stop()
        log.info("stopped")

"""Trigger (2) of the resync after a server outage (engine-events-and-subscriber.md §3.7).

The contract has no server instance id, so a server that restarted while the engine was quiet is
only visible as the gRPC connection going away and coming back. This watcher follows the
channel's connectivity state, asks an idle or failed channel to reconnect (the channel's own
reconnect backoff is capped at 1 s, see ``client.py``), and calls ``on_back`` when the channel is
READY again after having been READY before. Trigger (1), a successful RPC after failed ones, lives
in the forwarder. A spurious resync is harmless: re-stores are idempotent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc
import grpc.aio

log = logging.getLogger("inferencecache.subscriber")


async def watch_connectivity(
    channel: grpc.aio.Channel,
    on_back: Callable[[], None],
    current: Callable[[], grpc.aio.Channel] | None = None,
) -> None:
    """Run until cancelled; ``on_back()`` each time the connection returns after a loss.
    ``current``: the client's channel now; the watcher follows it when the client replaced the
    channel (renewed TLS files; the old one is then closed, which ends the wait)."""
    ready = grpc.ChannelConnectivity.READY
    state = channel.get_state(try_to_connect=True)
    was_ready = state == ready
    lost = False
    while True:
        await channel.wait_for_state_change(state)
        if current is not None and (fresh := current()) is not channel:
            channel = fresh  # not a loss: the server kept its state; a fresh start on the new one
            state = channel.get_state(try_to_connect=True)
            was_ready, lost = state == ready, False
            continue
        state = channel.get_state(try_to_connect=True)
        if state == ready:
            if lost:
                log.info("server connection is back; resyncing resident blocks")
                on_back()
            lost = False
            was_ready = True
        elif was_ready and not lost:
            lost = True
            log.warning("server connection lost", extra={"state": state.name})

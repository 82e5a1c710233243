"""What the aiohttp listeners here share: bounded body reads, and one app served on one TCP
address whose bound port is known (port 0 picks a free one).

Used by the server's HTTP surfaces, the gateway, the subscriber's metrics listener and the fake
and simulated engines, so a body limit or a bind behaves the same in each.
"""

from __future__ import annotations

from aiohttp import web


async def read_limited(request: web.Request, limit: int) -> bytes | None:
    """The request body, or None when it is larger than ``limit`` bytes (checked against the
    declared length first, then while reading, so a large body is never held whole)."""
    if request.content_length is not None and request.content_length > limit:
        return None
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = await request.content.readany()
        if not chunk:
            break
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


class Listener:
    """One app served on one TCP address from the caller's event loop."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> int:
        """Bind and serve (``host`` "" = every interface); returns the bound port. A bind error
        (OSError) leaves nothing running."""
        runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await runner.setup()
        try:
            site = web.TCPSite(runner, host or None, port, reuse_address=True)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        addresses = runner.addresses
        self.port = int(addresses[0][1]) if addresses else port
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

"""The HTTP side of a node, on aiohttp in the node's own event loop (next to grpc.aio):
the router's OpenAI API plus `/metrics`, or a worker's `/metrics` and `/health`.

Handlers are cancelled when their client disconnects, so a streaming request's cleanup
runs at once. aiohttp installs no signal handlers here: `runtime.server.serve` owns them.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from pdserve.runtime import metrics

log = logging.getLogger("pdserve.runtime.http")


async def start_http(app: web.Application, host: str, port: int, what: str) -> web.AppRunner:
    """Serve `app` on HOST:PORT (0: a free port) until `await runner.cleanup()`."""
    runner = web.AppRunner(app, handle_signals=False, access_log=None, handler_cancellation=True)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as err:  # taken since runtime/ports.py checked it: one line, no traceback
        await runner.cleanup()
        raise SystemExit(f"pdserve: cannot listen on {host}:{port} ({what}): {err.strerror}") from None
    bound = runner.addresses[0][1] if runner.addresses else port
    log.info("%s on http://%s:%s", what, host, bound)
    return runner


def metrics_app(refresh: Callable[[], Awaitable[None]] | None = None) -> web.Application:
    """`/metrics` (after `refresh()` samples the gauges) and `/health`."""

    async def scrape(request: web.Request) -> web.Response:
        if refresh is not None:
            await refresh()
        body, content_type = metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.add_routes([web.get("/metrics", scrape), web.get("/health", health)])
    return app

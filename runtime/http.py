"""The HTTP side of a node, on aiohttp in the node's own event loop (next to grpc.aio):
the router's OpenAI API plus `/metrics`, or a worker's `/metrics` and `/health`.

Handlers are cancelled when their client disconnects, so a streaming request's cleanup
runs at once. aiohttp installs no signal handlers here: `runtime.server.serve` owns them.

Invariants (one `HTTPConfig` per process, set at start from the `--http-*` flags):
- With a TLS certificate (`--tls-cert`) the port serves HTTPS with it, never plain HTTP
  unless `--plain-http` says so: the API key must not cross the network in clear.
- A connection gets `http_header_timeout_s` to send a request's headers (and no longer to
  sit idle between requests), then it is closed: aiohttp's keep-alive timer, which runs
  from the connection's start and is not reset by a byte of headers. A request's body
  must arrive within `http_body_timeout_s` (408), and is read only after the app's own
  middlewares ran, so an unauthenticated request is refused before its body is read.
- Beyond `http_max_connections` open connections a new one is closed at once.
- Browser pages of other origins are answered only as `--allowed-origins` says
  (runtime/cors.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from pdserve.runtime import cors, http_limits, metrics, tls
from pdserve.runtime.http_limits import HTTPConfig, configure, current  # noqa: F401

log = logging.getLogger("pdserve.runtime.http")


def _body_within(timeout_s: float):
    """Innermost middleware: the whole body read (aiohttp bounds its size by the app's
    `client_max_size`, 413) within `timeout_s` before the handler runs."""

    @web.middleware
    async def read_body(request: web.Request, handler):
        if request.body_exists:
            try:
                await asyncio.wait_for(request.read(), timeout_s)
            except asyncio.TimeoutError:
                raise web.HTTPRequestTimeout(
                    reason=f"request body not received within {timeout_s} s") from None
        return await handler(request)

    return read_body


def _limit_connections(server: web.Server, limit: int) -> None:
    """Close each connection made while `limit` are open. aiohttp has no such limit of its
    own, but tells its server of every connection it accepts before reading a byte."""
    made = server.connection_made

    def connection_made(handler, transport) -> None:
        made(handler, transport)
        if len(server.connections) > limit:
            transport.abort()

    server.connection_made = connection_made


async def start_http(app: web.Application, host: str, port: int, what: str) -> web.AppRunner:
    """Serve `app` on HOST:PORT (0: a free port) until `await runner.cleanup()`, over TLS
    when `runtime.tls` has a certificate (unless `--plain-http`)."""
    config = http_limits.current()
    app.middlewares.append(_body_within(config.http_body_timeout_s))
    cors.install(app, config.origins)
    runner = web.AppRunner(app, handle_signals=False, access_log=None, handler_cancellation=True,
                           keepalive_timeout=config.http_header_timeout_s)
    await runner.setup()
    _limit_connections(runner.server, config.http_max_connections)
    ssl_context = None if config.plain_http else tls.http_ssl_context()
    try:
        await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
    except OSError as err:  # taken since runtime/ports.py checked it: one line, no traceback
        await runner.cleanup()
        raise SystemExit(f"pdserve: cannot listen on {host}:{port} ({what}): {err.strerror}") from None
    bound = runner.addresses[0][1] if runner.addresses else port
    log.info("%s on %s://%s:%s", what, "https" if ssl_context else "http", host, bound)
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

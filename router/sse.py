"""Server-sent event answers that stay open while nothing comes: `EventStream` starts its
answer (status line, headers, opening events) with its first write, and `ticking` calls a
keep-alive whenever `--sse-keepalive-s` passes with no message.

Why: a request may wait long for its first token (queued behind a busy cluster, a long
prompt's prefill) or between two (preempted and recomputed), and proxies close a response
idle for their read timeout (60 s in nginx and AWS's load balancers), which the client
sees as a dropped connection. A keep-alive is a comment line (OpenAI's streams; every SSE
parser skips it) or Anthropic's `ping` event.

Invariant: until the first write, nothing was sent, so a failure can still answer with
its own HTTP status; after it, a failure is the stream's error event.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

COMMENT = b": keep-alive\n\n"
PING = b'event: ping\ndata: {"type": "ping"}\n\n'  # Anthropic's


class EventStream:
    def __init__(self, request: web.Request, headers: dict, keepalive: bytes = COMMENT) -> None:
        self.request, self.keepalive = request, keepalive
        self.response = web.StreamResponse(headers={
            **headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        self.opening = b""  # sent first, with the headers (an API's own start events)

    @property
    def started(self) -> bool:
        return self.response.prepared

    async def write(self, data: bytes) -> None:
        if not self.started:
            await self.response.prepare(self.request)
            data = self.opening + data
        if data:
            await self.response.write(data)

    async def keep_alive(self) -> None:
        await self.write(self.keepalive)

    async def end(self) -> web.StreamResponse:
        await self.write(b"")
        await self.response.write_eof()
        return self.response


async def ticking(messages: AsyncIterator, interval_s: float,
                  tick: Callable[[], Awaitable[None]]) -> AsyncIterator:
    """`messages`, awaiting `tick()` each time `interval_s` passes without one (never, when
    `interval_s` is 0). Closing this cancels a message still awaited, so `messages` can be
    closed after it."""
    if not interval_s:
        async for message in messages:
            yield message
        return
    done = object()
    pending = None
    try:
        while True:
            pending = asyncio.ensure_future(anext(messages, done))
            while not (await asyncio.wait({pending}, timeout=interval_s))[0]:
                await tick()
            message, pending = pending.result(), None
            if message is done:
                return
            yield message
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.wait({pending})

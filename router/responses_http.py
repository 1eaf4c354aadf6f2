"""The HTTP half of /v1/responses: an answer sent as OpenAI's named server-sent events or
whole (`respond`), kept in the router's store once it ended well (router/response_store.py);
the stored responses' own routes and the responses served in the background
(`StoredResponses`)."""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web

from pdserve.runtime.errors import NodeError

from . import responses_api
from .openai_protocol import OpenAIError
from .openai_shape import encoded
from .response_store import ResponseStore


async def respond(request, headers: dict, msg, messages, shape, answer, stream: bool, as_error, keep=None):
    """Send `answer` (a responses_api.ResponseStream) as its events, or its last state whole.
    `msg` is the chat answer's first message and `messages` the rest; `as_error` makes a
    node's failure an OpenAIError; `keep(response)` stores a response that completed or was
    cut short (not one that failed)."""
    response = None
    if stream:
        response = web.StreamResponse(headers={
            **headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)

    async def send(events: list[dict]) -> None:
        for event in events if response is not None else ():
            padded = answer.obfuscate and event["type"].endswith(".delta")  # OpenAI pads the deltas
            await response.write(f"event: {event['type']}\ndata: {encoded(event, padded)}\n\n".encode())

    await send(answer.start())
    try:
        while msg is not None:
            for part in shape.chunks(msg, include_usage=True):
                await send(answer.feed(part))
            msg = await anext(messages, None)
    except NodeError as err:
        error = responses_api.renamed(as_error(err))
        if response is None:
            raise error from None
        await send(answer.failed(error.body()["error"]))
        await response.write_eof()
        return response
    ended = answer.end()
    if keep is not None:
        keep(answer.response)
    await send(ended)
    if response is None:
        return web.json_response(answer.response, headers=headers)
    await response.write_eof()
    return response


class StoredResponses:
    """GET, DELETE, GET input_items and POST cancel of /v1/responses/{id}, each caller
    seeing its tenant's own (`tenant_of(request)`); and the responses sent with `background:
    true` (`start`): answered at once, "queued", then served by a task of their own. The
    store holds the live response, so GET reads its progress ("in_progress", then
    "completed", "incomplete" or "failed"); `cancel` ends one as "cancelled", its nodes
    aborting it as any request a client leaves. A background response the store's bound
    evicts while it runs is stored again when it ends."""

    def __init__(self, store: ResponseStore, tenant_of) -> None:
        self.store, self.tenant_of = store, tenant_of
        self._running: dict[tuple[str, str], asyncio.Task] = {}

    def start(self, tenant: str, answer, shape, messages, inputs: list[dict], as_error,
              headers: dict) -> web.Response:
        """Serve `messages` (the dispatch's stream) into `answer` in the background."""
        answer.response["status"] = "queued"
        self.store.put(tenant, answer.response, inputs)
        key = (tenant, answer.response["id"])
        self._running[key] = task = asyncio.ensure_future(
            self._serve(tenant, answer, shape, messages, inputs, as_error))
        task.add_done_callback(lambda _: self._running.pop(key, None))
        return web.json_response(answer.response, headers=headers)

    async def _serve(self, tenant: str, answer, shape, messages, inputs: list[dict], as_error) -> None:
        async with contextlib.aclosing(messages):
            try:
                async for msg in messages:
                    answer.response["status"] = "in_progress"
                    for part in shape.chunks(msg, include_usage=True):
                        answer.feed(part)
                answer.end()
            except NodeError as err:
                answer.failed(responses_api.renamed(as_error(err)).body()["error"])
            except asyncio.CancelledError:  # `cancel`: the stream closes, its nodes abort it
                answer.response["status"] = "cancelled"
            finally:
                self.store.put(tenant, answer.response, inputs)  # at its final size

    async def get(self, request: web.Request) -> web.Response:
        return web.json_response(self.store.get(self.tenant_of(request), request.match_info["id"])[0])

    async def input_items(self, request: web.Request) -> web.Response:
        return web.json_response(self.store.input_page(self.tenant_of(request), request.match_info["id"],
                                                       request.query))

    async def delete(self, request: web.Request) -> web.Response:
        tenant, response_id = self.tenant_of(request), request.match_info["id"]
        self.store.get(tenant, response_id)  # 404 when it is not there
        await self._stop(tenant, response_id)
        self.store.delete(tenant, response_id)
        return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})

    async def cancel(self, request: web.Request) -> web.Response:
        """A background response, cancelled if it still runs; as it ended otherwise (so a
        second cancel answers as the first did)."""
        tenant, response_id = self.tenant_of(request), request.match_info["id"]
        if not self.store.get(tenant, response_id)[0].get("background"):
            raise OpenAIError(400, f"Response {response_id!r:.80} was not created with background: true; only "
                                   "those can be cancelled.", "response_id", "invalid_argument")
        await self._stop(tenant, response_id)
        return web.json_response(self.store.get(tenant, response_id)[0])

    async def _stop(self, tenant: str, response_id: str) -> None:
        task = self._running.get((tenant, response_id))
        if task is not None:
            task.cancel()
            await asyncio.wait([task])

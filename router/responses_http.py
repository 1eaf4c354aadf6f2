"""The HTTP half of /v1/responses: an answer sent as OpenAI's named server-sent events
(`respond`) or whole (`answer_whole`), kept in the router's store once it ended well
(router/response_store.py); the stored responses' own routes and the responses served in
the background (`StoredResponses`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict

from aiohttp import web

from pdserve.runtime import http_limits
from pdserve.runtime.errors import NodeError

from .openai_protocol import OpenAIError
from .peers import Peers, asked_by_peer, or_peer
from .openai_shape import encoded
from .response_store import ResponseStore
from .sse import EventStream


def event_bytes(events: list[dict], obfuscate: bool) -> bytes:
    """Named server-sent events; OpenAI pads the deltas when `obfuscate`."""
    return b"".join(f"event: {e['type']}\ndata: {encoded(e, obfuscate and e['type'].endswith('.delta'))}\n\n"
                    .encode() for e in events)


async def respond(events: EventStream, messages, shape, answer, as_error, keep=None) -> web.StreamResponse:
    """Send `answer` (a responses_api.ResponseStream, or an anthropic_api.MessageStream) as
    its named events on `events`. `messages` is the chat answer's stream; `as_error` makes a
    node's failure the API's error (its HTTP status while nothing was sent yet);
    `keep(response)` stores a response that completed or was cut short (not one that failed)."""
    events.opening = event_bytes(answer.start(), answer.obfuscate)  # with the first write
    try:
        async for msg in messages:
            for part in shape.chunks(msg, include_usage=True):
                await events.write(event_bytes(answer.feed(part), answer.obfuscate))
    except NodeError as err:
        error = as_error(err)
        if not events.started:
            raise error from None
        await events.write(event_bytes(answer.failed(error), answer.obfuscate))
        return await events.end()
    ended = answer.end()
    if keep is not None:
        keep(answer.response)
    await events.write(event_bytes(ended, answer.obfuscate))
    return await events.end()


async def answer_whole(headers: dict, messages, shape, answer, as_error, keep=None) -> web.Response:
    """`respond`'s answer as one JSON body: the response in its last state."""
    answer.start()
    try:
        async for msg in messages:
            for part in shape.chunks(msg, include_usage=True):
                answer.feed(part)
    except NodeError as err:
        raise as_error(err) from None
    answer.end()
    if keep is not None:
        keep(answer.response)
    return web.json_response(answer.response, headers=headers)


class EventLog:
    """A background response's stream events, as its task makes them, for whoever follows
    them (the POST that created it with `stream: true`, a GET that resumes)."""

    def __init__(self, obfuscate: bool) -> None:
        self.events: list[dict] = []
        self.done = False
        self.obfuscate = obfuscate
        self._grew = asyncio.Condition()

    async def add(self, events: list[dict], done: bool = False) -> None:
        async with self._grew:
            self.events += events
            self.done = self.done or done
            self._grew.notify_all()

    async def follow(self, request, headers: dict, after: int) -> web.StreamResponse:
        """Send the events numbered past `after`, then each as it comes, until the last;
        a keep-alive comment whenever `--sse-keepalive-s` passes with none (router/sse.py)."""
        stream = EventStream(request, headers)
        await stream.write(b"")  # a GET that resumes answers at once
        interval_s = http_limits.current().sse_keepalive_s or None
        sent = next((i for i, e in enumerate(self.events) if e["sequence_number"] > after), len(self.events))
        while True:
            async with self._grew:
                try:
                    await asyncio.wait_for(self._grew.wait_for(lambda: sent < len(self.events) or self.done),
                                           interval_s)
                except asyncio.TimeoutError:
                    pass
                events, done = self.events[sent:], self.done
            if not events and not done:
                await stream.keep_alive()
                continue
            sent += len(events)
            await stream.write(event_bytes(events, self.obfuscate))
            if done and sent == len(self.events):
                break
        return await stream.end()


class StoredResponses:
    """GET, DELETE, GET input_items and POST cancel of /v1/responses/{id}, each caller
    seeing its tenant's own (`tenant_of(request)`); and the responses sent with `background:
    true` (`start`): answered at once, "queued", then served by a task of their own. The
    store holds the live response, so GET reads its progress ("in_progress", then
    "completed", "incomplete" or "failed"); `cancel` ends one as "cancelled", its nodes
    aborting it as any request a client leaves. A background response the store's bound
    evicts while it runs is stored again when it ends.

    With `stream: true` as well, the POST streams its events while the task runs, whether
    its client stays or not, and `GET /v1/responses/{id}?stream=true&starting_after=N`
    streams them again from event N + 1: those of a running response, and of the last
    `KEPT_LOGS` that ended."""

    KEPT_LOGS = 64

    def __init__(self, store: ResponseStore, tenant_of, peers: Peers | None = None) -> None:
        self.store, self.tenant_of, self.peers = store, tenant_of, peers
        self._running: dict[tuple[str, str], asyncio.Task] = {}
        self._logs: OrderedDict[tuple[str, str], EventLog] = OrderedDict()  # streamed ones', oldest first

    async def start(self, request, tenant: str, answer, shape, messages, inputs: list[dict], as_error,
                    headers: dict, stream: bool, ended) -> web.StreamResponse:
        """Serve `messages` (the dispatch's stream) into `answer` in the background;
        `ended(response)` once it completed or was cut short."""
        answer.response["status"] = "queued"
        self.store.put(tenant, answer.response, inputs)
        key = (tenant, answer.response["id"])
        log = None
        if stream:
            log = self._logs[key] = EventLog(answer.obfuscate)
            over = [k for k in self._logs if k not in self._running and k != key]  # a running one's stays
            for old in over[:max(0, len(self._logs) - self.KEPT_LOGS)]:
                del self._logs[old]
            await log.add(answer.created())
        self._running[key] = task = asyncio.ensure_future(
            self._serve(tenant, answer, shape, messages, inputs, as_error, log, ended))
        task.add_done_callback(lambda _: self._running.pop(key, None))
        if log is None:
            return web.json_response(answer.response, headers=headers)
        return await log.follow(request, headers, -1)

    async def _serve(self, tenant: str, answer, shape, messages, inputs: list[dict], as_error,
                     log: EventLog | None, ended) -> None:
        events: list[dict] = []
        async with contextlib.aclosing(messages):
            try:
                async for msg in messages:
                    events = answer.running() if answer.response["status"] == "queued" else []
                    for part in shape.chunks(msg, include_usage=True):
                        events += answer.feed(part)
                    if log is not None:
                        await log.add(events)
                events = answer.end()
            except NodeError as err:
                events = answer.failed(as_error(err))
            except asyncio.CancelledError:  # `cancel`: the stream closes, its nodes abort it
                answer.response["status"] = "cancelled"
                events = []
            finally:
                self.store.put(tenant, answer.response, inputs)  # at its final size
                if answer.response["status"] in ("completed", "incomplete"):
                    ended(answer.response)
                if log is not None:
                    await log.add(events, done=True)

    async def close(self) -> None:
        """End the background responses still running, as "cancelled" (the server stops)."""
        running = list(self._running.values())
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/v1/responses/{id}", or_peer(self.peers, self.get)),
                web.get("/v1/responses/{id}/input_items", or_peer(self.peers, self.input_items)),
                web.delete("/v1/responses/{id}", self.delete),
                web.post("/v1/responses/{id}/cancel", or_peer(self.peers, self.cancel))]

    async def fetch_previous(self, request: web.Request, body: dict) -> None:
        """Where a request continues a response this router lacks, take it from the peer
        router that stores it (router/peers.py), so it is continued here."""
        previous = body.get("previous_response_id")
        if self.peers is None or not isinstance(previous, str) or asked_by_peer(request):
            return
        tenant = self.tenant_of(request)
        if not self.store.has(tenant, previous):
            found = await self.peers.stored(request, previous)
            if found is not None:
                self.store.put(tenant, *found)

    async def get(self, request: web.Request) -> web.StreamResponse:
        tenant, response_id = self.tenant_of(request), request.match_info["id"]
        response = self.store.get(tenant, response_id)[0]
        if request.query.get("stream") not in ("true", "1"):
            return web.json_response(response)
        after = request.query.get("starting_after", "-1")
        if not after.lstrip("-").isdigit():
            raise OpenAIError(400, f"starting_after must be an event's sequence number, got {after!r:.80}",
                              "starting_after", "invalid_argument")
        log = self._logs.get((tenant, response_id))
        if log is None:
            raise OpenAIError(400, f"Response {response_id!r:.80} has no events kept to stream: only a background "
                                   "response created with stream: true has them, while it runs and for a while "
                                   "after. GET it without stream.", "stream", "invalid_argument")
        return await log.follow(request, {}, int(after))

    async def input_items(self, request: web.Request) -> web.Response:
        return web.json_response(self.store.input_page(self.tenant_of(request), request.match_info["id"],
                                                       request.query))

    async def delete(self, request: web.Request) -> web.Response:
        """Here, and on every peer router (a response continued through another router
        has a copy there): a 404 only when none had it."""
        tenant, response_id = self.tenant_of(request), request.match_info["id"]
        here = self.store.has(tenant, response_id)
        if here:
            await self._stop(tenant, response_id)
            self.store.delete(tenant, response_id)
            self._logs.pop((tenant, response_id), None)
        if self.peers is not None and not asked_by_peer(request):
            here = await self.peers.everywhere(request) or here
        if not here:
            self.store.get(tenant, response_id)  # its 404
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

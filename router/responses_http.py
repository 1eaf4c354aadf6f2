"""The HTTP half of /v1/responses: an answer sent as OpenAI's named server-sent events or
whole (`respond`), kept in the router's store once it ended well (router/response_store.py)."""

from __future__ import annotations

from aiohttp import web

from pdserve.runtime.errors import NodeError

from . import responses_api
from .openai_shape import encoded


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

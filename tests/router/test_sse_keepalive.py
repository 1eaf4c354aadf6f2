"""Streamed answers stay open while nothing comes (router/sse.py): a request held before its
first token gets keep-alives (an SSE comment; Anthropic's `ping` event) that every client
skips, then the same answer as one never held; a failure after a keep-alive is the
stream's error event, the HTTP status being already sent; a resumed background response
gets them too; and a client leaving while one waits cancels the wait cleanly."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import grpc
import pytest

from pdserve.router import sse
from pdserve.runtime import http_limits
from tests.router.fake_worker import FakeWorker, openai_router, run
from tests.router.test_background_responses import chat_tokenizer

HELLO = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def keepalives(monkeypatch):
    """Keep-alives every 10 ms, and an event set at the second one: a held stream is let
    through once it has surely sent some, however slow the machine."""
    monkeypatch.setattr(http_limits, "_config", http_limits.HTTPConfig(sse_keepalive_s=0.01))
    state = {"sent": 0, "event": None}
    real = sse.EventStream.keep_alive

    async def counted(self):
        await real(self)
        state["sent"] += 1
        if state["sent"] == 2:
            state["event"].set()

    monkeypatch.setattr(sse.EventStream, "keep_alive", counted)

    def held_worker(**kwargs) -> FakeWorker:
        """A decode node that streams once two keep-alives went out."""
        worker = FakeWorker("d", **kwargs)
        worker.stream_gate = state["event"] = asyncio.Event()
        state["sent"] = 0
        return worker

    return held_worker


async def raw(url: str, path: str, body: dict) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, json=body) as reply:
            return reply.status, await reply.text()


def test_a_held_chat_stream_gets_comments_then_the_answer_any_client_reads(keepalives, tmp_path):
    import openai

    async def go():
        tokenizer = chat_tokenizer(tmp_path)
        async with openai_router([keepalives(texts=["Hi", " there"])], tokenizer) as url:
            status, text = await raw(url, "/v1/chat/completions", {**HELLO, "stream": True})
        async with openai_router([keepalives(texts=["Hi", " there"])], tokenizer) as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            chunks = [c async for c in await client.chat.completions.create(**HELLO, stream=True)]
        return status, text, chunks

    status, text, chunks = run(go())
    assert status == 200
    blocks = text.strip().split("\n\n")
    first_data = next(i for i, b in enumerate(blocks) if b.startswith("data: "))
    assert first_data >= 2 and set(blocks[:first_data]) == {": keep-alive"}
    data = [json.loads(b.removeprefix("data: ")) for b in blocks if b.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in data if c["choices"]) == "Hi there"
    assert blocks[-1] == "data: [DONE]"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hi there"


def test_a_failure_after_a_keepalive_is_the_streams_error_event(keepalives, tmp_path):
    async def go():
        worker = keepalives(fail={"StartGeneration.stream": grpc.StatusCode.INVALID_ARGUMENT})
        async with openai_router([worker], chat_tokenizer(tmp_path)) as url:
            return await raw(url, "/v1/chat/completions", {**HELLO, "stream": True})

    status, text = run(go())
    assert status == 200  # sent with the first keep-alive
    blocks = text.strip().split("\n\n")
    assert blocks[0] == ": keep-alive" and blocks[-1] == "data: [DONE]"
    error = json.loads(blocks[-2].removeprefix("data: "))["error"]
    assert "failed on purpose" in error["message"] and error["type"] == "invalid_request_error"


def test_anthropic_streams_get_ping_events_after_message_start(keepalives, tmp_path):
    import anthropic

    body = {"model": "fake", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}

    async def go():
        tokenizer = chat_tokenizer(tmp_path)
        async with openai_router([keepalives(texts=["Paris"])], tokenizer) as url:
            status, text = await raw(url, "/v1/messages", {**body, "stream": True})
        async with openai_router([keepalives(texts=["Paris"])], tokenizer) as url:
            client = anthropic.AsyncAnthropic(base_url=url, api_key="none", max_retries=0)
            async with client.messages.stream(**body) as stream:
                message = await stream.get_final_message()
        return status, text, message

    status, text, message = run(go())
    names = [b.split("\n", 1)[0] for b in text.strip().split("\n\n")]
    assert status == 200 and names[0] == "event: message_start"
    assert names[1] == names[2] == "event: ping" and names[-1] == "event: message_stop"
    assert [b.text for b in message.content] == ["Paris"] and message.stop_reason == "max_tokens"


def test_responses_and_a_resumed_background_response_get_comments(keepalives, tmp_path):
    import openai

    async def go():
        tokenizer = chat_tokenizer(tmp_path)
        async with openai_router([keepalives(texts=["Paris"])], tokenizer) as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            events = [e async for e in await client.responses.create(model="fake", input="hi", stream=True)]
        async with openai_router([keepalives(texts=["Paris"])], tokenizer) as url:
            status, text = await raw(url, "/v1/responses", {"model": "fake", "input": "hi", "background": True,
                                                           "stream": True})
        return events, status, text

    events, status, text = run(go())
    # the fake node stops at its last token with "length": max_output_tokens' "incomplete"
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == "Paris"
    blocks = text.strip().split("\n\n")
    assert status == 200 and blocks.count(": keep-alive") >= 2
    assert blocks[-1].startswith("event: response.incomplete")


def test_closing_a_ticking_stream_cancels_the_message_it_waits_for():
    async def go():
        finished = []

        async def source():
            try:
                yield 1
                await asyncio.Event().wait()  # a node that never answers again
                yield 2
            finally:
                finished.append("closed")

        ticks = asyncio.Event()

        async def tick():
            ticks.set()

        messages = source()
        ticked = sse.ticking(messages, 0.001, tick)
        assert await anext(ticked) == 1
        waiting = asyncio.ensure_future(anext(ticked))
        await ticks.wait()
        waiting.cancel()  # the client left
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await ticked.aclose()
        await messages.aclose()  # not "already running": the wait was cancelled first
        return finished

    assert run(go()) == ["closed"]

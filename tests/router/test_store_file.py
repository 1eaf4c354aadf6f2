"""`--responses-store-dir` (router/store_file.py): stored responses and conversations
outlive a restart of the server that stored them (read, listed and continued through the
next one), a background response the stop cut off reads "cancelled"; a second server is
refused the directory while the first keeps it; an unreadable file is moved aside and the
server starts with none; a smaller bound after the restart keeps the most recently used."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from pdserve.router import store_file
from pdserve.router.conversations import Conversations
from pdserve.router.response_store import ResponseStore
from pdserve.router.responses_http import StoredResponses
from pdserve.runtime import http_limits
from tests.router.fake_worker import FakeWorker, openai_router, run
from tests.router.test_background_responses import chat_tokenizer


def stores(max_mb: float = 1.0) -> tuple[StoredResponses, Conversations]:
    return StoredResponses(ResponseStore(max_mb), lambda r: "default"), Conversations(max_mb, lambda r: "default")


def text_of(item) -> str:
    return item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)


def test_stored_responses_and_conversations_outlive_a_restart(tmp_path, monkeypatch):
    import openai

    monkeypatch.setattr(http_limits, "_config", http_limits.HTTPConfig(responses_store_dir=str(tmp_path / "kept")))
    tokenizer = chat_tokenizer(tmp_path)

    async def before():
        worker = FakeWorker("d", texts=["Paris"])
        async with openai_router([worker], tokenizer) as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            answered = await client.responses.create(model="fake", input="capital of France?")
            talk = await client.conversations.create(items=[{"type": "message", "role": "user", "content": "hi"}])
            worker.stream_gate = asyncio.Event()  # held until the server stops
            held = await client.responses.create(model="fake", input="and Spain?", background=True)
            return answered, talk, held

    async def after(answered, talk, held):
        async with openai_router([FakeWorker("d", texts=["Rome"])], tokenizer) as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            again = await client.responses.retrieve(answered.id)
            items = await client.conversations.items.list(talk.id)
            cut = await client.responses.retrieve(held.id)
            follow = await client.responses.create(model="fake", input="and Italy?", previous_response_id=answered.id)
            given = await client.responses.input_items.list(follow.id, order="asc")
            return again, items, cut, follow, given

    answered, talk, held = run(before())
    again, items, cut, follow, given = run(after(answered, talk, held))
    assert again.model_dump() == answered.model_dump()
    assert [text_of(i) for i in items.data] == ["hi"]
    assert cut.status == "cancelled"
    assert follow.output_text == "Rome"
    assert [text_of(i) for i in given.data] == ["capital of France?", "Paris", "and Italy?"]


def test_a_second_server_is_refused_the_directory_the_first_keeps(tmp_path):
    first = web.Application()
    store_file.keep(first, str(tmp_path), *stores())
    with pytest.raises(SystemExit, match="kept by another running server"):
        store_file.keep(web.Application(), str(tmp_path), *stores())

    async def stop():
        runner = web.AppRunner(first)
        await runner.setup()
        await runner.cleanup()  # writes, and lets the directory go

    asyncio.run(stop())
    store_file.keep(web.Application(), str(tmp_path), *stores())


def test_an_unreadable_file_is_moved_aside_and_the_server_starts_with_none(tmp_path, caplog):
    (tmp_path / store_file.FILE).write_text('{"version": 1, "responses": [["default", {"no": "id"}, []]], '
                                            '"conversations": []}')
    stored, conversations = stores()
    store_file.keep(web.Application(), str(tmp_path), stored, conversations)
    assert stored.store.snapshot() == [] and not (tmp_path / store_file.FILE).exists()
    assert (tmp_path / (store_file.FILE + ".unreadable")).exists() and "could not be read" in caplog.text


def test_a_smaller_bound_keeps_the_most_recently_used(tmp_path):
    big = ResponseStore(1.0)
    for i in range(3):
        big.put("default", {"id": f"resp_{i}", "output": [], "text": "x" * 400}, [])
    big.get("default", "resp_0")  # used last
    small = ResponseStore(1000 / 2**20)  # room for two
    small.restore(json.loads(json.dumps(big.snapshot())))
    assert [r["id"] for _, r, _ in small.snapshot()] == ["resp_2", "resp_0"]

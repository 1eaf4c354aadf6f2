"""`--responses-store-dir` (router/store_file.py): stored responses and conversations
outlive a restart of the server that stored them (read, listed and continued through the
next one), a background response the stop cut off reads "cancelled"; a second server is
refused the directory while the first keeps it; an unreadable file is moved aside and the
server starts with none; a smaller bound after the restart keeps the most recently used.
The journal (a kill's safety, tests/cluster/test_store_kill.py) skips a half-written last
line, stays within twice what the stores hold, and replayed over a file that already holds
its changes gives the same stores."""

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
    assert stored.store.snapshot() == [] == json.loads((tmp_path / store_file.FILE).read_text())["responses"]
    assert (tmp_path / (store_file.FILE + ".unreadable")).exists() and "could not be read" in caplog.text


def test_a_smaller_bound_keeps_the_most_recently_used(tmp_path):
    big = ResponseStore(1.0)
    for i in range(3):
        big.put("default", {"id": f"resp_{i}", "output": [], "text": "x" * 400}, [])
    big.get("default", "resp_0")  # used last
    small = ResponseStore(1000 / 2**20)  # room for two
    small.restore(json.loads(json.dumps(big.snapshot())))
    assert [r["id"] for _, r, _ in small.snapshot()] == ["resp_2", "resp_0"]


def kept(tmp_path, max_mb: float = 1.0) -> tuple[StoredResponses, Conversations]:
    """The stores a server starting on `tmp_path` keeps (its lock let go again)."""
    stored, conversations = stores(max_mb)
    app = web.Application()
    store_file.keep(app, str(tmp_path), stored, conversations)

    async def stop():
        runner = web.AppRunner(app)
        await runner.setup()
        await runner.cleanup()

    asyncio.run(stop())
    return stored, conversations


def test_a_half_written_journal_line_is_skipped_and_the_lines_before_it_applied(tmp_path, caplog):
    whole = json.dumps(["response", "default", {"id": "resp_1", "output": []}, []])
    deleted = json.dumps(["conversation_deleted", "default", "conv_gone"])
    (tmp_path / store_file.JOURNAL).write_text(f"{whole}\n{deleted}\n{whole[:30]}")
    stored, _ = kept(tmp_path)
    assert [r["id"] for _, r, _ in stored.store.snapshot()] == ["resp_1"]
    assert "line 3 could not be read" in caplog.text
    assert (tmp_path / store_file.JOURNAL).read_text() == ""  # folded into the file


def test_the_journal_stays_within_twice_what_the_stores_hold(tmp_path, monkeypatch):
    monkeypatch.setattr(store_file, "MIN_FOLD_CHARS", 2000)
    store, conversations = ResponseStore(1.0), Conversations(1.0, lambda r: "default")
    journal = store_file.Journal(tmp_path, store, conversations)
    store.journal = journal.add
    sizes = []
    for i in range(200):  # the same response again and again: the stores hold one
        store.put("default", {"id": "resp_1", "output": [], "n": i}, [])
        sizes.append((tmp_path / store_file.JOURNAL).stat().st_size)
    assert max(sizes) <= 2000 + 200 and min(sizes[10:]) < 200  # folded, several times
    assert json.loads((tmp_path / store_file.FILE).read_text())["responses"][0][1]["n"] >= 150


def test_changes_replayed_over_a_file_that_holds_them_give_the_same_stores(tmp_path):
    store, conversations = ResponseStore(1.0), Conversations(1.0, lambda r: "default")
    journal = store_file.Journal(tmp_path, store, conversations)
    store.journal = conversations.journal = journal.add
    for i in range(3):
        store.put("default", {"id": f"resp_{i}", "output": [], "status": "completed"}, [])
    store.delete("default", "resp_1")
    conversations.restore([["default", {"id": "conv_1", "metadata": {}}, [{"id": "msg_1", "type": "message"}]]])
    conversations.forget("default", "conv_1")
    lines = (tmp_path / store_file.JOURNAL).read_text()
    journal.fold()  # a kill before the journal was emptied: the next start replays it all again
    (tmp_path / store_file.JOURNAL).write_text(lines)
    stored, again = kept(tmp_path)
    assert stored.store.snapshot() == store.snapshot() and [e[0] for e in store.snapshot()] == ["default"] * 2
    assert again.snapshot() == conversations.snapshot() == []

"""Stored responses (router/response_store.py): `previous_response_id` continues a stored
conversation, GET and DELETE read and remove one, its input items list in pages, each
tenant sees only its own, and the store keeps no more than its bound, the least recently
used going first."""

from __future__ import annotations

import json

import pytest

from pdserve.router.openai_protocol import OpenAIError
from pdserve.router.response_store import ResponseStore


def response(response_id: str, text: str = "x") -> dict:
    return {"id": response_id, "object": "response", "output": [{"type": "message", "role": "assistant",
                                                                 "content": [{"type": "output_text", "text": text}]}]}


def test_each_tenant_finds_only_its_own_and_a_deleted_one_is_gone():
    store = ResponseStore(1)
    store.put("alice", response("r1"), [{"type": "message", "role": "user", "content": "hi"}])
    got, conversation = store.get("alice", "r1")
    assert got == response("r1") and conversation[1:] == response("r1")["output"]
    assert conversation[0]["id"].startswith("msg_") and conversation[0]["content"] == "hi"
    for tenant, response_id in (("bob", "r1"), ("alice", "r2")):
        with pytest.raises(OpenAIError) as err:
            store.get(tenant, response_id, "previous_response_id")
        assert (err.value.status, err.value.param) == (404, "previous_response_id")
        assert "never stored here" in err.value.message
    assert store.delete("alice", "r1") and not store.delete("alice", "r1") and store.chars == 0
    with pytest.raises(OpenAIError) as err:
        store.get("alice", 5)
    assert err.value.status == 400


def test_the_bound_evicts_the_least_recently_used_and_zero_keeps_none():
    one = len(json.dumps(response("r0", "a" * 1000))) + len(json.dumps([]))
    store = ResponseStore(3.5 * one / 2**20)  # room for three
    for i in range(3):
        assert store.put("t", response(f"r{i}", "a" * 1000), [])
    store.get("t", "r0")  # used: r1 is now the least recently used
    store.put("t", response("r3", "a" * 1000), [])
    assert store.chars <= store.max_chars
    with pytest.raises(OpenAIError):
        store.get("t", "r1")
    assert [store.get("t", f"r{i}")[0]["id"] for i in (0, 2, 3)] == ["r0", "r2", "r3"]
    assert not store.put("t", response("big", "a" * 10 * one), [])  # alone over the bound: not kept
    off = ResponseStore(0)
    assert not off.put("t", response("r"), [])
    with pytest.raises(OpenAIError, match="stores no responses"):
        off.get("t", "r")


def test_previous_response_id_continues_the_conversation_and_get_and_delete_answer(tmp_path):
    import aiohttp

    from pdserve.engine.checkpoint import CHAT_TEMPLATE
    from pdserve.router.tokenizer import PromptTokenizer
    from tests.chat_checkpoint import write_tokenizer_only
    from tests.router.fake_worker import FakeWorker, openai_router, run

    tokenizer = PromptTokenizer(str(write_tokenizer_only(tmp_path, CHAT_TEMPLATE)), "fake")
    worker = FakeWorker("d", texts=["Paris", "."])

    async def go():
        replies = []
        async with openai_router([worker], tokenizer) as url, aiohttp.ClientSession() as session:
            async def call(method, path, body=None):
                async with session.request(method, url + path, json=body) as reply:
                    replies.append((reply.status, await reply.json()))
                    return replies[-1][1]

            first = await call("POST", "/v1/responses", {"model": "fake", "input": "capital of France?",
                                                         "instructions": "be brief"})
            await call("GET", f"/v1/responses/{first['id']}")
            await call("POST", "/v1/responses", {"model": "fake", "input": "and of Spain?",
                                                 "previous_response_id": first["id"], "store": False})
            await call("GET", f"/v1/responses/{replies[-1][1]['id']}")  # store: false kept nothing
            await call("DELETE", f"/v1/responses/{first['id']}")
            await call("POST", "/v1/responses", {"model": "fake", "input": "hi", "previous_response_id": first["id"]})
        return replies

    (s1, first), (s2, got), (s3, second), (s4, _), (s5, deleted), (s6, gone) = run(go())
    assert (s1, s2, s3, s4, s5, s6) == (200, 200, 200, 404, 200, 404)
    assert got == first and first["store"] is True and first["output"]
    assert second["previous_response_id"] == first["id"] and second["store"] is False
    assert deleted == {"id": first["id"], "object": "response.deleted", "deleted": True}
    assert gone["error"]["param"] == "previous_response_id"
    prompts = [list(msg.prepare.prompt_token_ids) for rpc, msg in worker.calls if rpc == "StartGeneration"]
    assert len(prompts) == 2
    # the second turn: the first's input and answer, then its own input, under its own (no) instructions
    assert prompts[1] == tokenizer.chat_ids([
        {"role": "user", "content": "capital of France?"}, {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "and of Spain?"}])
    assert "be brief" in tokenizer.decode(prompts[0]) and "be brief" not in tokenizer.decode(prompts[1])


def test_input_items_list_in_pages_with_their_ids_and_bad_queries_name_the_parameter():
    store = ResponseStore(1)
    given = [{"type": "message", "role": "user", "content": f"q{i}"} for i in range(5)]
    given[2] = {"type": "function_call_output", "call_id": "c1", "output": "42"}
    given[3] = {**given[3], "id": "msg_given"}  # an item that has an id keeps it
    store.put("t", response("r"), given)
    ids = [item["id"] for item in store.input_page("t", "r", {"order": "asc"})["data"]]
    assert len(set(ids)) == 5 and ids[3] == "msg_given" and ids[2].startswith("item_")
    newest = store.input_page("t", "r", {})  # desc by default, 20 at most
    assert [i["id"] for i in newest["data"]] == ids[::-1] and not newest["has_more"]
    assert (newest["first_id"], newest["last_id"], newest["object"]) == (ids[4], ids[0], "list")
    page = store.input_page("t", "r", {"order": "asc", "limit": "2", "after": ids[0]})
    assert [i["id"] for i in page["data"]] == ids[1:3] and page["has_more"]
    assert [i["id"] for i in store.input_page("t", "r", {"order": "asc", "before": ids[1]})["data"]] == [ids[0]]
    back = store.input_page("t", "r", {"limit": "2", "before": ids[1]})  # the page just before, newest first
    assert [i["id"] for i in back["data"]] == [ids[3], ids[2]] and back["has_more"]
    assert store.input_page("t", "r", {"order": "asc", "after": ids[4]})["data"] == []
    # the continuation's input items: the stored ones, ids kept, then its own
    assert store.get("t", "r")[1][:5] == store.input_page("t", "r", {"order": "asc"})["data"]
    for query, param, named in (({"limit": "0"}, "limit", "'0'"), ({"limit": "101"}, "limit", "'101'"),
                                ({"limit": "x"}, "limit", "'x'"), ({"order": "up"}, "order", "'up'"),
                                ({"after": "msg_nope"}, "after", "'msg_nope'"),
                                ({"before": "msg_nope"}, "before", "'msg_nope'"), ({"page": "2"}, "page", "'page'")):
        with pytest.raises(OpenAIError) as err:
            store.input_page("t", "r", query)
        assert (err.value.status, err.value.param) == (400, param) and named in err.value.message
    with pytest.raises(OpenAIError) as err:
        store.input_page("other", "r", {})
    assert err.value.status == 404


def test_the_openai_client_lists_a_continued_responses_input_items(tmp_path):
    import aiohttp
    import openai

    from pdserve.engine.checkpoint import CHAT_TEMPLATE
    from pdserve.router.tokenizer import PromptTokenizer
    from tests.chat_checkpoint import write_tokenizer_only
    from tests.router.fake_worker import FakeWorker, openai_router, run

    tokenizer = PromptTokenizer(str(write_tokenizer_only(tmp_path, CHAT_TEMPLATE)), "fake")

    async def go():
        async with openai_router([FakeWorker("d", texts=["Paris", "."])], tokenizer) as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            first = await client.responses.create(model="fake", input="capital of France?")
            second = await client.responses.create(model="fake", input="and of Spain?",
                                                   previous_response_id=first.id)
            oldest_first = [item async for item in client.responses.input_items.list(second.id, order="asc")]
            paged = [item async for item in client.responses.input_items.list(second.id, limit=1)]
            async with aiohttp.ClientSession() as session:
                async with session.get(f"{url}/v1/responses/{second.id}/input_items?limit=500") as reply:
                    bad = reply.status, await reply.json()
                async with session.get(f"{url}/version") as reply:
                    version = await reply.json()
            return first, oldest_first, paged, bad, version

    first, items, paged, (status, bad), version = run(go())
    assert [(i.type, i.role) for i in items] == [("message", "user"), ("message", "assistant"), ("message", "user")]
    assert items[1].id == first.output[0].id and items[1].content[0].text == "Paris."
    assert items[2].content == "and of Spain?" or items[2].content[0].text == "and of Spain?"
    assert [i.id for i in paged] == [i.id for i in items][::-1]  # one per page, newest first
    assert status == 400 and bad["error"]["param"] == "limit" and "500" in bad["error"]["message"]
    from importlib.metadata import version as installed
    assert version == {"version": installed("pdserve")}

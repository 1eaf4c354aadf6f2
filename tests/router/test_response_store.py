"""Stored responses (router/response_store.py): `previous_response_id` continues a stored
conversation, GET and DELETE read and remove one, each tenant sees only its own, and the
store keeps no more than its bound, the least recently used going first."""

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
    store.put("alice", response("r1"), [{"role": "user", "content": "hi"}])
    assert store.get("alice", "r1") == (response("r1"), [{"role": "user", "content": "hi"}])
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

"""Routers that are each other's `--peer-router` (router/peers.py): a response stored by one
is read, listed, continued, streamed, cancelled and deleted through the other, for its own
tenant only; an id no router has is a 404 with no ask going round, and a peer that cannot
be reached is skipped. Two in-process routers (their OpenAI fronts) over one fake decode
node, with API keys."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import aiohttp

from pdserve.engine.checkpoint import CHAT_TEMPLATE
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch import Dispatcher
from pdserve.router.openai_http import OpenAIFrontend
from pdserve.router.peers import Peers
from pdserve.router.policies import RoundRobin
from pdserve.router.registry import WorkerRegistry
from pdserve.router.tokenizer import PromptTokenizer
from pdserve.runtime.http import start_http
from pdserve.runtime.tenants import KeyRing
from tests.chat_checkpoint import write_tokenizer_only
from tests.router.fake_worker import FakeWorker, start_fake

KEYS = {"alice": "key-alice", "bob": "key-bob"}
ALICE, BOB = ({"Authorization": f"Bearer {KEYS[t]}"} for t in ("alice", "bob"))
DEAD = "127.0.0.1:9"  # the discard port: nothing listens


@asynccontextmanager
async def two_routers(tmp_path):
    """Routers A and B, each the other's peer (B also names a dead one): their URLs."""
    tokenizer = PromptTokenizer(str(write_tokenizer_only(tmp_path, CHAT_TEMPLATE)), "fake")
    server, decode = await start_fake(FakeWorker("d", token_delay_s=0.01))
    peers = [Peers([]), Peers([])]
    registries, runners = [], []
    for own in peers:
        registry = WorkerRegistry([], [decode], RoundRobin(), RoundRobin())
        dispatcher = Dispatcher(RouterConfig(model="fake", decode=[decode], full_retry_s=0.1), registry)
        frontend = OpenAIFrontend(dispatcher, tokenizer, "fake", api_keys=KeyRing(KEYS), peers=own)
        registries.append(registry)
        runners.append(await start_http(frontend.app(), "127.0.0.1", 0, "test"))
    addresses = [f"127.0.0.1:{r.addresses[0][1]}" for r in runners]
    peers[0].targets, peers[1].targets = [addresses[1]], [DEAD, addresses[0]]
    try:
        yield [f"http://{a}" for a in addresses]
    finally:
        for runner, registry in zip(runners, registries):
            await runner.cleanup()
            await registry.close()
        await server.stop(None)


async def call(session, method, url, headers, body=None) -> tuple[int, dict | str]:
    async with session.request(method, url, headers=headers, json=body) as reply:
        text = await reply.text()
        return reply.status, json.loads(text) if reply.content_type == "application/json" else text


def test_a_response_stored_by_one_router_is_read_continued_and_deleted_through_the_other(tmp_path):
    async def go():
        async with two_routers(tmp_path) as (a, b), aiohttp.ClientSession() as s:
            status, first = await call(s, "POST", f"{a}/v1/responses", ALICE,
                                       {"model": "fake", "input": "name a fox", "max_output_tokens": 3})
            assert status == 200, first
            rid = first["id"]
            assert await call(s, "GET", f"{b}/v1/responses/{rid}", ALICE) == (200, first)
            status, items = await call(s, "GET", f"{b}/v1/responses/{rid}/input_items?order=asc", ALICE)
            assert status == 200 and [i["content"] for i in items["data"]] == ["name a fox"], items
            # another tenant's key: the peer has nothing for bob
            status, error = await call(s, "GET", f"{b}/v1/responses/{rid}", BOB)
            assert status == 404 and "not found" in error["error"]["message"]

            status, second = await call(s, "POST", f"{b}/v1/responses", ALICE, {
                "model": "fake", "input": "and a dog", "previous_response_id": rid, "max_output_tokens": 3})
            assert status == 200, second
            status, chain = await call(s, "GET", f"{a}/v1/responses/{second['id']}/input_items?order=asc", ALICE)
            assert status == 200, chain
            assert [i["id"] for i in chain["data"][:2]] == [items["data"][0]["id"], first["output"][0]["id"]]
            assert chain["data"][2]["content"] == "and a dog"

            status, deleted = await call(s, "DELETE", f"{b}/v1/responses/{rid}", ALICE)
            assert (status, deleted["deleted"]) == (200, True)
            assert (await call(s, "GET", f"{a}/v1/responses/{rid}", ALICE))[0] == 404
            status, error = await call(s, "GET", f"{b}/v1/responses/resp_never", ALICE)  # asked round once
            assert status == 404 and "resp_never" in error["error"]["message"]
    asyncio.run(asyncio.wait_for(go(), 60))


def test_a_background_response_streams_and_cancels_through_the_other_router(tmp_path):
    async def go():
        async with two_routers(tmp_path) as (a, b), aiohttp.ClientSession() as s:
            status, queued = await call(s, "POST", f"{a}/v1/responses", ALICE, {
                "model": "fake", "input": "name a fox", "max_output_tokens": 3, "background": True, "stream": True})
            assert status == 200
            rid = next(json.loads(block.split("data: ", 1)[1])["response"]["id"]
                       for block in queued.strip().split("\n\n"))
            status, text = await call(s, "GET", f"{b}/v1/responses/{rid}?stream=true&starting_after=0", ALICE)
            events = [json.loads(block.split("data: ", 1)[1]) for block in text.strip().split("\n\n")]
            assert status == 200 and events[0]["sequence_number"] == 1
            assert events[-1]["type"] == "response.incomplete"  # cut at max_output_tokens
            status, cancelled = await call(s, "POST", f"{b}/v1/responses/{rid}/cancel", ALICE)
            assert (status, cancelled["status"]) == (200, "incomplete")  # it had ended: as it ended
    asyncio.run(asyncio.wait_for(go(), 60))


def test_a_conversation_made_on_one_router_is_used_through_the_other(tmp_path):
    async def go():
        async with two_routers(tmp_path) as (a, b), aiohttp.ClientSession() as s:
            status, made = await call(s, "POST", f"{a}/v1/conversations", ALICE,
                                      {"items": [{"role": "user", "content": "hello"}]})
            assert status == 200, made
            cid = made["id"]
            assert await call(s, "GET", f"{b}/v1/conversations/{cid}", ALICE) == (200, made)
            assert (await call(s, "GET", f"{b}/v1/conversations/{cid}", BOB))[0] == 404  # not bob's
            status, added = await call(s, "POST", f"{b}/v1/conversations/{cid}/items", ALICE,
                                       {"items": [{"role": "user", "content": "name a fox"}]})
            assert status == 200, added
            # a response naming it, through B: served by A, which keeps the conversation
            status, answer = await call(s, "POST", f"{b}/v1/responses", ALICE, {
                "model": "fake", "input": "and a dog", "conversation": cid, "max_output_tokens": 3})
            assert status == 200, answer
            status, items = await call(s, "GET", f"{a}/v1/conversations/{cid}/items?order=asc", ALICE)
            assert [i.get("content") for i in items["data"][:3]] == ["hello", "name a fox", "and a dog"]
            assert items["data"][3]["id"] == answer["output"][0]["id"] and len(items["data"]) == 4
            status, deleted = await call(s, "DELETE", f"{b}/v1/conversations/{cid}", ALICE)
            assert status == 200 and deleted["deleted"] is True
            assert (await call(s, "GET", f"{a}/v1/conversations/{cid}", ALICE))[0] == 404
    asyncio.run(asyncio.wait_for(go(), 60))

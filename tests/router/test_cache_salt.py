"""The prefix-cache salt on the router's side: which salt a request runs under, the prefix
index and routing seeing only same-salt prefixes, the salt reaching every node's message,
and the OpenAI body's `cache_salt` checked as vLLM checks it. The request's priority, which
travels the same way, likewise."""

from __future__ import annotations

import pytest

from pdserve.client import AsyncClient
from pdserve.router import selective
from pdserve.router.cache_salt import effective_salt
from pdserve.router.openai_protocol import OpenAIError, placement_of
from pdserve.router.policies import PrefixAware
from pdserve.router.prefix_index import PrefixIndex
from tests.router.fake_worker import FakeWorker, openai_router, run, start_router

PROMPT = list(range(100, 148))  # three blocks of 16


def test_each_tenant_gets_its_own_salt_and_the_open_cluster_keeps_none():
    assert effective_salt("default") == ""  # an open cluster caches as before tenants
    salts = {effective_salt(t, s) for t in ("default", "alice", "bob") for s in ("", "x", "y")}
    assert len(salts) == 9 and "" in salts
    # No client salt can spell another tenant's: tenant names hold no NUL.
    assert effective_salt("alice", "") != effective_salt("default", "alice")
    assert effective_salt("alice", "x") == "alice\x00x"


def test_a_shared_prefix_cache_salts_by_the_clients_salt_alone():
    assert effective_salt("alice", "x", shared=True) == effective_salt("bob", "x", shared=True)
    assert effective_salt("alice", "", shared=True) == ""
    with pytest.raises(ValueError, match="cache_salt must be a string, got 7"):
        effective_salt("alice", 7)


def test_prefix_index_matches_only_under_the_salt_it_recorded():
    index = PrefixIndex(block=16)
    index.insert(PROMPT, "alice\x00")
    assert index.match(PROMPT, "alice\x00") == 48
    assert index.match(PROMPT, "bob\x00") == 0
    assert index.match(PROMPT) == 0
    index.insert(PROMPT[:32])  # unsalted: as before salts, a separate chain
    assert index.match(PROMPT) == 32
    assert index.match(PROMPT, "bob\x00") == 0


class Node:
    def __init__(self, queue=0):
        self.queue, self.free_pages, self.send_wait_s = queue, 0, 0.0
        self.prefixes = PrefixIndex(block=16)


def test_prefix_aware_routing_follows_only_the_requests_salt():
    nodes = [Node(), Node()]
    nodes[1].prefixes.insert(PROMPT, "alice\x00")
    policy = PrefixAware()
    assert all(policy.pick(nodes, PROMPT, "alice\x00") is nodes[1] for _ in range(4))
    # Bob's pick tells nothing of Alice's prompt: the two are tied and go in turn.
    assert {id(policy.pick(nodes, PROMPT, "bob\x00")) for _ in range(4)} == {id(n) for n in nodes}


def test_selective_plan_counts_only_the_salts_hit():
    decode, prefill = Node(), Node()
    decode.prefixes.insert(PROMPT, "alice\x00")
    same = selective.plan(PROMPT, -1, decode, [prefill], [decode], min_remote_prefill_tokens=16,
                          cache_salt="alice\x00")
    other = selective.plan(PROMPT, -1, decode, [prefill], [decode], min_remote_prefill_tokens=16,
                           cache_salt="bob\x00")
    assert (same.local, same.reason) == (True, "short_window")  # D holds it: no RemoteSend
    assert other.local is False


def test_openai_cache_salt_is_a_non_empty_string_if_given():
    salt = lambda body: placement_of(body)["cache_salt"]  # noqa: E731
    assert salt({}) == "" and salt({"cache_salt": None}) == ""
    assert salt({"cache_salt": "s1"}) == "s1"
    for bad in ("", 7, ["s"]):
        with pytest.raises(OpenAIError, match="cache_salt must be a non-empty string") as err:
            salt({"cache_salt": bad})
        assert err.value.param == "cache_salt" and err.value.status == 400


@pytest.mark.parametrize("overlap", [True, False])
def test_the_effective_salt_and_the_priority_reach_every_node_message(overlap):
    async def go():
        p, d = FakeWorker("p"), FakeWorker("d")
        addr, _, stop = await start_router([p], [d], overlap_prefill=overlap)
        try:
            async with AsyncClient(addr) as client:
                await client.generate("hello", request_id="s1", cache_salt="c1", priority=-3)
                await client.generate("hello", request_id="s2", kv_window_end=0, priority=7)
        finally:
            await stop()
        by_request = {}
        for worker in (p, d):
            for rpc, msg in worker.calls:
                inner = msg.prepare if rpc == "StartGeneration" and msg.HasField("prepare") else msg
                if hasattr(inner, "cache_salt"):
                    by_request.setdefault(msg.request_id, set()).add((rpc, inner.cache_salt, inner.priority))
        assert by_request["s1"] == {("PrepareReceive", "default\x00c1", -3),
                                    ("RemoteSend", "default\x00c1", -3)}
        # D prefills it all (kv_window_end 0); the open tenant without a salt: unsalted.
        assert ("StartGeneration", "", 7) in by_request["s2"]
        assert {(salt, priority) for _, salt, priority in by_request["s2"]} == {("", 7)}

    run(go())


def test_openai_priority_is_a_32_bit_integer_and_reaches_the_decode_node():
    async def go():
        import aiohttp

        worker = FakeWorker("d")
        async with openai_router([worker]) as url, aiohttp.ClientSession() as session:
            replies = []
            for priority in (4, 1.5, True, 2**31):
                async with session.post(f"{url}/v1/completions", json={
                        "model": "fake", "prompt": "hi", "max_tokens": 2, "priority": priority}) as reply:
                    replies.append((reply.status, (await reply.json()).get("error")))
        return worker, replies

    worker, replies = run(go())
    assert replies[0] == (200, None)
    for status, error in replies[1:]:
        assert status == 400 and error["param"] == "priority" and "lower is served first" in error["message"]
    [sent] = [msg for rpc, msg in worker.calls if rpc == "StartGeneration"]
    assert sent.prepare.priority == 4  # one decode node and no prefill node: D prefills it

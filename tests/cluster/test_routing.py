"""2 prefill + 2 decode nodes found through a real etcd: requests spread as each policy
says, and prefix-aware routing sends a follow-up to the node that holds its prefix."""

from __future__ import annotations

import asyncio
import collections
import random

from pdserve.client import AsyncClient
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.runtime.server import channel
from tests.cluster.conftest import SCALE_PAGE as PAGE
from tests.cluster.nodes import run, wait_until

GREEDY = dict(temperature=0.0, max_tokens=2, ignore_eos=True)


def prompt(seed: int, n: int = 24) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


async def routes(router: str, prompts, **kwargs) -> list[dict]:
    async with AsyncClient(router) as client:
        return [(await client.generate(p, **GREEDY, **kwargs)).usage.route for p in prompts]


def test_round_robin_spreads_requests_evenly_over_both_pools(scale_cluster):
    c = scale_cluster
    got = run(routes(c.address("rr"), [prompt(100 + i) for i in range(4)]))
    prefill = collections.Counter(c.name_of(r.prefill_endpoint) for r in got)
    decode = collections.Counter(c.name_of(r.decode_endpoint) for r in got)
    assert prefill == {"p1": 2, "p2": 2} and decode == {"d1": 2, "d2": 2}, got


HOLD_S = 110  # the work parked below outlives the waits for the router to see it (3 x 25 s at most)


async def _park(address: str, n: int, tag: str) -> list[str]:
    """Reserve `n` requests on a decode node directly: load no router sent."""
    ids = [f"{tag}-{i}" for i in range(n)]
    async with channel(address) as ch:
        stub = pdserve_pb2_grpc.WorkerStub(ch)
        for rid in ids:
            await stub.PrepareReceive(pdserve_pb2.PrepareReceiveRequest(
                request_id=rid, prompt_token_ids=prompt(7), kv_window_end=-1,
                lease_ms=HOLD_S * 1000), timeout=10)
    return ids


async def _abort(address: str, ids: list[str]) -> None:
    async with channel(address) as ch:
        stub = pdserve_pb2_grpc.WorkerStub(ch)
        for rid in ids:
            await stub.Abort(pdserve_pb2.AbortRequest(request_id=rid, kv_write_settled=True),
                             timeout=10)


def _endpoint_queues(c) -> dict[tuple[str, str], float]:
    """The ll router's /metrics: (pool, node name) -> the queue it sees there."""
    return {(dict(labels)["pool"], c.name_of(dict(labels)["endpoint"])): value
            for (name, labels), value in c.scrape("ll").items()
            if name == "pdserve_router_endpoint_queue"}


def test_least_loaded_avoids_the_nodes_busy_with_work_from_elsewhere(scale_cluster):
    """d1 holds 3 reservations and p1 works on 2 RemoteSends that no router sent: the
    least-loaded router sees them in the nodes' load reports and uses d2 and p2."""
    c = scale_cluster

    async def go():
        parked = await _park(c.address("d1"), 3, "parked")
        seen = {}

        def seen_by_router():  # the ll router's last load reports show that work
            seen.update(queues=_endpoint_queues(c))
            return seen["queues"].get(("decode", "d1"), 0) >= 3 and \
                seen["queues"].get(("prefill", "p1"), 0) >= 2

        async with channel(c.address("p1")) as ch:  # RemoteSends waiting for a window
            stub = pdserve_pb2_grpc.WorkerStub(ch)
            # p1 ends a RemoteSend whose window never comes after its --transfer-timeout-s
            # (30 s): on a machine slow enough that the router has not seen them by 25 s,
            # they are sent again, twice at most, before the test fails naming what it saw.
            for attempt in range(3):
                ids = [f"busy-{attempt}-{i}" for i in range(2)]
                busy = [asyncio.ensure_future(stub.RemoteSend(pdserve_pb2.RemoteSendRequest(
                    request_id=rid, prompt_token_ids=prompt(8 + i), kv_window_end=-1 + 24,
                    window_follows=True), timeout=HOLD_S)) for i, rid in enumerate(ids)]
                try:
                    await asyncio.to_thread(wait_until, seen_by_router, lambda: "the ll router's "
                                            f"view of the load (last seen: {seen})", 25)
                    got = await routes(c.address("ll"), [prompt(200 + i) for i in range(4)])
                    break
                except AssertionError:
                    if attempt == 2:
                        raise
                finally:
                    await _abort(c.address("p1"), ids)
                    await asyncio.gather(*busy, return_exceptions=True)
        await _abort(c.address("d1"), parked)
        return got

    got = run(go())
    assert {c.name_of(r.decode_endpoint) for r in got} == {"d2"}, got
    assert {c.name_of(r.prefill_endpoint) for r in got} == {"p2"}, got


def test_prefix_aware_sends_a_shared_prefix_follow_up_to_the_node_holding_it(scale_cluster):
    """The px router (prefix_aware on both pools, --min-remote-prefill-tokens 16)."""
    c = scale_cluster
    shared = 5 * PAGE  # 40 tokens: five full pages on every node it went to

    async def go():
        out = {}
        for seed, group in enumerate(("a", "b")):
            base = prompt(1000 + seed, shared)
            first = base + prompt(1, 8)
            long_tail = base + prompt(2, 32)   # D lacks 31 tokens of the window: P sends them
            short_tail = base + prompt(3, 8)   # D lacks 7: it prefills them itself
            out[group] = await routes(c.address("px"), [first, long_tail, short_tail])
        return out

    for group, (first, long_tail, short_tail) in run(go()).items():
        assert not first.remote_send_skipped and first.prefix_matched_length == 0
        # The follow-up with a long new tail: same decode and prefill node, both hitting
        # the shared prefix.
        assert long_tail.decode_endpoint == first.decode_endpoint, group
        assert long_tail.prefill_endpoint == first.prefill_endpoint, group
        assert long_tail.prefix_matched_length == shared, long_tail
        assert long_tail.prefill_cached_tokens == shared, long_tail
        # The follow-up with a short new tail: selective disaggregation, D alone, reusing
        # its cached prefix.
        assert short_tail.decode_endpoint == first.decode_endpoint, group
        assert short_tail.remote_send_skipped and short_tail.skip_reason == "short_window"
        assert short_tail.prefill_endpoint == ""
        assert short_tail.prefix_matched_length >= shared, short_tail


def test_several_routers_share_no_state_and_all_route_every_node(scale_cluster):
    """Three routers watching the same etcd prefix see the same four nodes."""
    c = scale_cluster

    async def go():
        seen = {}
        for name in ("rr", "ll", "px"):
            got = await routes(c.address(name), [prompt(300 + i, 12) for i in range(4)])
            seen[name] = {c.name_of(r.decode_endpoint) for r in got}
        return seen

    seen = run(go())
    assert seen["rr"] == {"d1", "d2"}
    assert all(s <= {"d1", "d2"} for s in seen.values()), seen


def test_a_prompt_cache_key_sends_a_conversation_to_the_same_nodes_through_every_router(scale_cluster):
    """Each turn of a conversation reaches another router (as behind a load balancer); with
    its prompt_cache_key every turn lands on the same decode node, which holds the earlier
    turns' prefix, whatever each router's policy; keys spread over both nodes."""
    c = scale_cluster

    async def go():
        turns, conversation = [], prompt(2000, 5 * PAGE)
        for i, name in enumerate(("rr", "ll", "px", "rr", "ll")):
            conversation = conversation + prompt(2100 + i, 8)
            async with AsyncClient(c.address(name)) as client:
                out = await client.generate(conversation, **GREEDY, prompt_cache_key="conversation-7")
            turns.append(out.usage.route)
        spread = {}
        for name in ("rr", "ll"):
            async with AsyncClient(c.address(name)) as client:
                spread[name] = [c.name_of((await client.generate(prompt(2200 + k, 12), **GREEDY,
                                                                 prompt_cache_key=f"user-{k}")).usage.route.decode_endpoint)
                                for k in range(20)]
        return turns, spread

    turns, spread = run(go())
    assert len({r.decode_endpoint for r in turns}) == 1, turns
    assert all(r.prefix_matched_length >= 5 * PAGE for r in turns[1:]), turns  # each found the last
    assert spread["rr"] == spread["ll"] and set(spread["rr"]) == {"d1", "d2"}, spread

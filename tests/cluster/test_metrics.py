"""/metrics on the router and on both workers, scraped before and after known traffic: the
counters move by exactly what was sent, and the page gauges return to an idle pool."""

from __future__ import annotations


import grpc
import pytest

from pdserve.client import AsyncClient
from tests.cluster.nodes import load, run, sample, wait_until

GREEDY = dict(temperature=0.0, max_tokens=4, ignore_eos=True)
# Long enough to fill whole pages (page size 8), so the repeat finds them in the prefix cache.
LONG = "the quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun " * 2


def delta(after: dict, before: dict, name: str, **labels) -> float:
    return sample(after, name, **labels) - sample(before, name, **labels)


def scrape_all(cluster) -> dict[str, dict]:
    return {node: cluster.scrape(node) for node in ("router", "prefill", "decode")}


def test_counters_move_by_the_traffic_sent(cluster):
    c = cluster
    before = scrape_all(c)
    prefill_before = run(load(c.address("prefill")))

    async def traffic():
        async with AsyncClient(c.grpc) as client:
            outs = [await client.generate(p, **GREEDY) for p in (LONG, LONG, "hello there")]
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await client.generate("hello", top_p=1.5)
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            return outs

    outs = run(traffic())
    usages = [o.usage for o in outs]
    routes = [u.route for u in usages]
    prompt_tokens = sum(u.prompt_tokens for u in usages)
    matched = sum(r.prefix_matched_length for r in routes)
    sent_tokens = sum(r.kv_window_end - r.kv_window_begin for r in routes
                      if not r.remote_send_skipped)
    assert matched > 0, "the repeated long prompt should hit the decode node's prefix cache"
    def settled():  # every node has recorded the end of all three streams
        now = scrape_all(c)
        done = all(delta(now[n], before[n], "pdserve_requests_total", role=n, outcome="length") == 3
                   for n in ("router", "decode"))
        return now if done else None

    after = wait_until(settled, "the router and decode node to record the three streams")
    prefill_after = run(load(c.address("prefill")))
    r0, r1 = before["router"], after["router"]
    assert delta(r1, r0, "pdserve_requests_total", role="router", outcome="length") == 3
    assert delta(r1, r0, "pdserve_requests_total", role="router", outcome="invalid_argument") == 1
    for hist in ("ttft", "tpot", "e2e"):
        assert delta(r1, r0, f"pdserve_request_{hist}_seconds_count", role="router") == 3
    assert delta(r1, r0, "pdserve_generation_tokens_total", role="router") == 3 * GREEDY["max_tokens"]
    assert delta(r1, r0, "pdserve_prompt_tokens_total", role="router") == prompt_tokens
    assert delta(r1, r0, "pdserve_router_prefix_matched_tokens_total") == matched
    assert sample(r1, "pdserve_queue_depth", role="router", queue="in_flight") == 0
    assert sample(r1, "pdserve_router_endpoint_routable", pool="decode",
                  endpoint=c.address("decode")) == 1

    d0, d1 = before["decode"], after["decode"]
    assert delta(d1, d0, "pdserve_requests_total", role="decode", outcome="length") == 3
    assert delta(d1, d0, "pdserve_request_ttft_seconds_count", role="decode") == 3
    assert delta(d1, d0, "pdserve_generation_tokens_total", role="decode") == 3 * GREEDY["max_tokens"]
    assert delta(d1, d0, "pdserve_prefix_cache_query_tokens_total", role="decode") == prompt_tokens
    assert delta(d1, d0, "pdserve_prefix_cache_hit_tokens_total", role="decode") == matched
    assert 0 < sample(d1, "pdserve_prefix_cache_hit_rate", role="decode") <= 1

    p0, p1 = before["prefill"], after["prefill"]
    sends = prefill_after.remote_sends_total - prefill_before.remote_sends_total
    assert sends == sum(not r.remote_send_skipped for r in routes) >= 2
    assert delta(p1, p0, "pdserve_kv_transfers_total", outcome="ok") == sends
    assert delta(p1, p0, "pdserve_kv_transfer_bytes_total") == \
        prefill_after.kv_bytes_sent_total - prefill_before.kv_bytes_sent_total > 0
    assert delta(p1, p0, "pdserve_kv_transfer_tokens_total") == sent_tokens
    assert delta(p1, p0, "pdserve_kv_transfer_descriptors_total") >= sends
    for hist in ("kv_transfer_seconds", "kv_transfer_bandwidth_bytes_per_second", "prefill_seconds"):
        assert delta(p1, p0, f"pdserve_{hist}_count") == sends
    assert delta(p1, p0, "pdserve_requests_total", role="prefill", outcome="ok") == sends


def test_page_gauges_show_an_idle_pool_after_traffic(cluster):
    c = cluster

    def idle():
        samples = {node: c.scrape(node) for node in ("prefill", "decode")}
        used = [sample(s, "pdserve_kv_pages_used", role=n) for n, s in samples.items()]
        return samples if not any(used) else None

    samples = wait_until(idle, "every page of both workers to be free")
    for node, s in samples.items():
        total = sample(s, "pdserve_kv_pages_total", role=node)
        assert total == 256  # --num-pages in WORKER_FLAGS
        assert sample(s, "pdserve_kv_pages_used", role=node) == 0
        assert sample(s, "pdserve_kv_pages_free", role=node) == total
        assert sample(s, "pdserve_queue_depth", role=node, queue="waiting") == 0
        assert sample(s, "pdserve_node_info", role=node, model=c.model) == 1

"""Under load a request waits for its turn instead of being refused (issue 18), on a real
router + prefill + decode whose decode node has a small KV cache (40 pages of 8 tokens):

- a burst whose KV is several times the cache completes in full, each answer equal to the
  same request run alone, first tokens in the order the requests came, every page back;
- a request whose deadline passes while it waits for pages gets DEADLINE_EXCEEDED and
  takes nothing from the requests holding the pages;
- past the router's queue bound a client gets RESOURCE_EXHAUSTED with `retry-after`
  trailers, over HTTP 429 with Retry-After.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import grpc
import pytest

from pdserve.client import AsyncClient
from pdserve.procs import free_port
from tests.cluster.nodes import (GREEDY, Cluster, gate_open, gate_reached, load, run, sample,
                                 scrape, wait_for, wait_pools_full, wait_until)

HELD = "held-"  # the decode node holds these streams after their first token
SLOW = "slow-"  # the prefill node holds these before their prefill
PAGES = 40
DECODE_FLAGS = ["--num-threads", "1", "--num-pages", str(PAGES), "--page-size", "8",
                "--max-parked-fraction-per-caller", "1", "--test-gates", HELD]


def prompt(i: int, n: int = 100) -> list[int]:  # distinct from the first token: no shared prefix
    return [(i * 37 + j * 11) % 480 + 20 for j in range(n)]


class SmallCacheCluster(Cluster):
    def build(self) -> None:
        common = ["--model", self.model, "--host", "127.0.0.1"]
        self.start("prefill", ["prefill", *common, "--num-threads", "1", "--num-pages", "256",
                               "--page-size", "8", "--test-gates", SLOW], wait=False)
        self.decode_http = free_port()
        self.start("decode", ["decode", *common, *DECODE_FLAGS, "--metrics-port",
                              str(self.decode_http)], wait=False)
        self.wait("prefill", "decode")
        workers = ["--prefill", self.address("prefill"), "--decode", self.address("decode")]
        self.start("main", ["router", *common, *workers], wait=False)
        self.tight_http = free_port()
        self.start("tight", ["router", *common, *workers, "--max-concurrent-requests", "1",
                             "--max-queued-requests", "1", "--http-port",
                             str(self.tight_http)], wait=False)
        self.wait("main", "tight")


@pytest.fixture(scope="module")
def small(tiny_model, tmp_path_factory):
    cluster = SmallCacheCluster(tmp_path_factory.mktemp("admission-logs"), tiny_model)
    try:
        cluster.build()
        yield cluster
    finally:
        cluster.stop()


def test_a_burst_several_times_the_cache_completes_in_full_and_in_order(small):
    c = small
    # Each reserves 25 of the 40 pages and grows to 38: one at a time, the rest in line. The
    # first one's prefill is held at the prefill node's gate (its 25 pages reserved) until
    # all the others are in line, so they wait however fast the engine is.
    n, length, max_tokens = 6, 200, 100
    first = f"{SLOW}burst-0"

    async def go():
        before = await at_decode(c)
        async with AsyncClient(c.address("main")) as client:
            sent, seen, calls = [], [], []
            for i in range(n):
                sent.append(time.monotonic())
                calls.append(asyncio.ensure_future(client.generate(
                    prompt(i, length), max_tokens=max_tokens, timeout=120,
                    **({"request_id": first} if i == 0 else {}), **GREEDY)))

                async def arrived(count=i + 1) -> bool:  # the order of arrival to keep
                    return await at_decode(c) - before >= count
                await wait_for(arrived, timeout_s=30, poll_s=0.01)
                seen.append(time.monotonic())  # it reached the decode node by now
                if i == 0:
                    await gate_reached(c.address("prefill"), "prefill", first)
            opened = time.monotonic()
            for phase in ("kv_write", "prefill"):  # the prefill node holds both phases
                await gate_open(c.address("prefill"), phase, first)
            outs = await asyncio.gather(*calls)
            alone = [await client.generate(prompt(i, length), max_tokens=max_tokens, **GREEDY)
                     for i in range(n)]
        reports = await wait_pools_full([c.address("prefill"), c.address("decode")])
        return sent, seen, opened, outs, alone, reports

    sent, seen, opened, outs, alone, reports = run(go(), timeout_s=240)
    assert [o.token_ids for o in outs] == [a.token_ids for a in alone]
    assert all(len(o.token_ids) == max_tokens for o in outs)
    waits = [o.usage.queue_time_s for o in outs]
    # Each of the others was in line from before `seen` until after the gate opened.
    assert all(w >= opened - s for w, s in zip(waits[1:], seen[1:])), (waits, opened, seen)
    first_tokens = [s + o.usage.time_to_first_token_s for s, o in zip(sent, outs)]
    assert first_tokens == sorted(first_tokens), (first_tokens, waits)
    assert all(r.free_pages == r.total_pages and r.num_parked == 0 for r in reports), reports


def test_a_request_whose_deadline_passes_in_line_gets_deadline_exceeded_and_takes_nothing(small):
    """Two reservations hold 38 of the 40 pages while their prefill is held at the prefill
    node's gate; a third request waits in the decode node's line until its deadline."""
    c = small
    held = [f"{SLOW}deadline-{i}" for i in range(2)]

    async def parked() -> bool:
        return (await load(c.address("decode"))).num_parked == 2

    async def go():
        async with AsyncClient(c.address("main")) as client:
            holders = [asyncio.ensure_future(client.generate(
                prompt(50 + i, 150), request_id=rid, max_tokens=8, **GREEDY))
                for i, rid in enumerate(held)]  # 19 pages each
            for rid in held:
                await gate_reached(c.address("prefill"), "prefill", rid)
            await wait_for(parked, timeout_s=10)
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.generate(prompt(60), max_tokens=8, timeout=2, **GREEDY)
            waited = time.monotonic() - started
            in_line = (await load(c.address("decode"))).num_parked
            for rid in held:
                for phase in ("kv_write", "prefill"):  # the prefill node holds both phases
                    await gate_open(c.address("prefill"), phase, rid)
            outs = await asyncio.gather(*holders)
            alone = [await client.generate(prompt(50 + i, 150), max_tokens=8, **GREEDY)
                     for i in range(2)]
        reports = await wait_pools_full([c.address("prefill"), c.address("decode")])
        return err.value, waited, in_line, outs, alone, reports

    err, waited, in_line, outs, alone, reports = run(go(), timeout_s=120)
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.details()
    assert waited > 1.5  # it waited in line for its deadline (2 s), not refused at once
    assert in_line == 2  # it took nothing: the two held reservations are all D holds
    assert [o.token_ids for o in outs] == [a.token_ids for a in alone]
    assert all(r.free_pages == r.total_pages and r.num_parked == 0 for r in reports), reports


async def at_decode(c: SmallCacheCluster) -> float:
    """Reservations that reached the decode node: granted so far, or waiting in its line.
    Granted ones are read first: one granted between the two reads is missed (the caller
    waits a poll longer), never counted twice."""
    granted = (await load(c.address("decode"))).requests_total
    line = sample(await asyncio.to_thread(scrape, f"http://127.0.0.1:{c.decode_http}/metrics"),
                  "pdserve_queue_depth", role="decode", queue="page_line")
    return granted + line


def in_router(c: SmallCacheCluster) -> float:
    """Requests the tight router holds, running or queued (its /metrics)."""
    samples = scrape(f"http://127.0.0.1:{c.tight_http}/metrics")
    return sample(samples, "pdserve_queue_depth", role="router", queue="in_flight")


def test_past_the_queue_bound_a_client_gets_429_with_retry_after(small):
    c = small
    rid = f"{HELD}slot"

    def http_completion() -> urllib.error.HTTPError:
        base = f"http://127.0.0.1:{c.tight_http}/v1"
        with urllib.request.urlopen(f"{base}/models", timeout=10) as reply:
            model = json.loads(reply.read())["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": prompt(70, 10), "max_tokens": 2}).encode()
        request = urllib.request.Request(f"{base}/completions",
                                         body, {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=30)
        return err.value

    async def go():
        async with AsyncClient(c.address("tight")) as client:
            running = asyncio.ensure_future(client.generate(
                prompt(71, 10), request_id=rid, max_tokens=4, **GREEDY))  # holds the one slot
            await gate_reached(c.address("decode"), "stream", rid)
            queued = asyncio.ensure_future(client.generate(prompt(72, 10), max_tokens=4,
                                                           **GREEDY))  # the one queue place
            await asyncio.to_thread(wait_until, lambda: in_router(c) == 2,
                                    "the second request in the router's queue")
            queued_at = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as grpc_err:
                await client.generate(prompt(73, 10), max_tokens=4, **GREEDY)
            http_err = await asyncio.to_thread(http_completion)
            in_queue_s = time.monotonic() - queued_at  # at least: it is still queued here
            await gate_open(c.address("decode"), "stream", rid)
            outs = [await running, await queued]
        return grpc_err.value, http_err, outs, in_queue_s

    grpc_err, http_err, outs, in_queue_s = run(go(), timeout_s=120)
    assert grpc_err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "router is full" in grpc_err.details()
    assert grpc_err.retry_after_s == 1  # gRPC's trailers say it as HTTP's Retry-After does
    assert ("grpc-retry-pushback-ms", "1000") in tuple(grpc_err.trailing_metadata())
    assert http_err.code == 429 and http_err.headers["Retry-After"] == "1"
    assert json.loads(http_err.read())["error"]["type"] == "rate_limit_error"
    assert all(len(o.token_ids) == 4 for o in outs)
    assert outs[1].usage.queue_time_s >= in_queue_s  # its wait for a turn, in its usage

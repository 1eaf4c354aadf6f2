"""SIGTERM drains: no new work is accepted, the streams in flight finish normally."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest

from pdserve.client import Client
from tests.e2e.procs import Node
from tests.faults.cluster import GREEDY, ROUTER_FLAGS, SLOW, full, load, wait_pools_full
from tests.faults.conftest import run


async def _consume(stream):
    tokens, reason = [], ""
    async for msg in stream:
        tokens += msg.token_ids
        reason = msg.finish_reason or reason
    return tokens, reason


def test_sigterm_on_the_router_lets_streams_finish_and_refuses_new_ones(fault_cluster, tmp_path):
    c = fault_cluster
    router = Node(["router", "--model", c.model, "--host", "127.0.0.1", "--port", "0",
                   "--prefill", f"{c.address('p1')},{c.address('p2')}",
                   "--decode", f"{c.address('d1')},{c.address('d2')}", *ROUTER_FLAGS],
                  tmp_path / "router.log")

    async def go():
        async with Client(router.address) as client:
            # In flight at SIGTERM: its prefill node holds it ~3 s (SLOW), then it decodes.
            stream = asyncio.ensure_future(_consume(client.stream(
                "drain me slowly", request_id=f"{SLOW}drain", max_tokens=300, **GREEDY)))
            await asyncio.sleep(0.5)
            os.killpg(router.proc.pid, signal.SIGTERM)
            await asyncio.sleep(0.3)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.complete("too late", max_tokens=2, timeout=10)
            tokens, reason = await stream
        return tokens, reason, refused.value

    try:
        tokens, reason, refused = run(go())
        router.proc.wait(timeout=20)  # it exits once the stream is done
    finally:
        router.stop()
    assert len(tokens) == 300 and reason == "length"
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert router.proc.returncode is not None


def test_sigterm_on_a_decode_node_finishes_its_stream_while_traffic_moves_on(fault_cluster):
    c = fault_cluster

    async def go():
        async with Client(c.address("main")) as client:
            stream = client.stream("a stream on a node about to stop", max_tokens=300, **GREEDY)
            first = await stream.__anext__()
            running = {d: (await load(c.address(d))).num_running for d in ("d1", "d2")}
            victim = next(d for d, n in running.items() if n)
            other = "d2" if victim == "d1" else "d1"
            os.killpg(c.nodes[victim].proc.pid, signal.SIGTERM)
            await asyncio.sleep(0.3)
            during = [await client.complete(f"during drain {i}", max_tokens=3, timeout=20,
                                            **GREEDY) for i in range(3)]
            tokens, reason = await _consume(stream)
            t0 = time.monotonic()
            while c.nodes[victim].proc.poll() is None and time.monotonic() - t0 < 20:
                await asyncio.sleep(0.1)
            exited = c.nodes[victim].proc.poll() is not None
            reports = await wait_pools_full([c.address(n) for n in ("p1", "p2", other)])
        return victim, other, list(first.token_ids) + tokens, reason, during, exited, reports

    try:
        victim, other, tokens, reason, during, exited, reports = run(go())
    finally:
        for name in ("d1", "d2"):
            if c.nodes[name].proc.poll() is not None:
                c.restart(name)
    assert len(tokens) == 300 and reason == "length"
    assert all(o.usage["route"]["decode_endpoint"] == c.address(other) for o in during)
    assert exited
    assert all(full(r) for r in reports), reports

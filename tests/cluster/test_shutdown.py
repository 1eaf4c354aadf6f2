"""SIGTERM drains: no new work is accepted, the streams in flight finish normally."""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.client import AsyncClient
from pdserve.runtime.server import channel
from tests.cluster.conftest import HELD, ROUTER_FLAGS, SLOW
from tests.cluster.nodes import (GREEDY, Cluster, full, gate_open, load, run, stopped_at,
                                 wait_for, wait_pools_full)


async def _consume(stream):
    tokens, reason = [], ""
    async for msg in stream:
        tokens += msg.token_ids
        reason = msg.finish_reason or reason
    return tokens, reason


async def _not_serving(address: str) -> bool:
    async with channel(address) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                           timeout=5)
    return reply.status == health_pb2.HealthCheckResponse.NOT_SERVING


def test_sigterm_on_the_router_lets_streams_finish_and_refuses_new_ones(fault_cluster, tmp_path):
    c = fault_cluster
    extra = Cluster(tmp_path, c.model)
    router = extra.start("router", [
        "router", "--model", c.model, "--host", "127.0.0.1",
        "--prefill", f"{c.address('p1')},{c.address('p2')}",
        "--decode", f"{c.address('d1')},{c.address('d2')}", *ROUTER_FLAGS])
    request_id = f"{SLOW}drain"

    async def go():
        async with AsyncClient(router.address) as client:
            # In flight at SIGTERM: held at its prefill node's gate, then it decodes.
            stream = asyncio.ensure_future(_consume(client.responses(
                "drain me slowly", request_id=request_id, max_tokens=300, **GREEDY)))
            prefill = await stopped_at(c, "prefill", request_id)
            router.send_signal(signal.SIGTERM)
            await wait_for(lambda: _not_serving(router.address), timeout_s=10)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.generate("too late", max_tokens=2, timeout=10)
            for phase in ("prefill", "kv_write"):
                await gate_open(c.address(prefill), phase, request_id)
            tokens, reason = await stream
        return tokens, reason, refused.value

    try:
        tokens, reason, refused = run(go())
        router.proc.wait(timeout=20)  # it exits once the stream is done
    finally:
        extra.stop()
    assert len(tokens) == 300 and reason == "length"
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert router.proc.returncode == 0


def test_sigterm_on_a_decode_node_finishes_its_stream_while_traffic_moves_on(fault_cluster):
    c = fault_cluster

    async def go():
        async with AsyncClient(c.address("main")) as client:
            # Held by its decode node after the first token, so it is still in flight at
            # SIGTERM however fast the engine is.
            request_id = f"{HELD}sigterm-decode"
            stream = client.responses("a stream on a node about to stop", request_id=request_id,
                                      max_tokens=300, **GREEDY)
            first = await stream.__anext__()
            running = {d: (await load(c.address(d))).num_running for d in ("d1", "d2")}
            victim = next(d for d, n in running.items() if n)
            other = "d2" if victim == "d1" else "d1"
            c.nodes[victim].send_signal(signal.SIGTERM)
            await wait_for(lambda: _not_serving(c.address(victim)), timeout_s=10)
            during = [await client.generate(f"during drain {i}", max_tokens=3, timeout=20,
                                            **GREEDY) for i in range(3)]
            await gate_open(c.address(victim), "stream", request_id)
            tokens, reason = await _consume(stream)
            code = await asyncio.to_thread(c.nodes[victim].proc.wait, 20)
            reports = await wait_pools_full([c.address(n) for n in ("p1", "p2", other)])
        return victim, other, list(first.token_ids) + tokens, reason, during, code, reports

    try:
        victim, other, tokens, reason, during, code, reports = run(go())
    finally:
        for name in ("d1", "d2"):
            if not c.nodes[name].alive():
                c.restart(name)
    assert len(tokens) == 300 and reason == "length"
    assert all(o.usage.route.decode_endpoint == c.address(other) for o in during)
    assert code == 0  # it exited by itself once its stream was done
    assert all(full(r) for r in reports), reports

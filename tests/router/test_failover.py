"""The router absorbs node failures the client need not see, against fake workers:
another prefill node, then the decode node prefilling itself; another decode node; and a
bounded queue (RESOURCE_EXHAUSTED past it)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.client import Client
from tests.router.fake_worker import FakeWorker
from tests.router.fake_worker import start_router, run

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


class RecordingWorker(FakeWorker):
    """Also records whether each Abort said no write could still come."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.aborts: list[tuple[str, bool]] = []

    async def Abort(self, request, context):
        self.aborts.append((request.request_id, request.kv_write_settled))
        return await super().Abort(request, context)


def test_failed_remote_send_is_retried_on_another_prefill_node_with_a_fresh_reservation():
    async def go():
        p1, p2 = FakeWorker("p1", fail={"RemoteSend": UNAVAILABLE}), FakeWorker("p2")
        d = RecordingWorker("d")
        addr, _, stop = await start_router([p1, p2], [d])
        try:
            async with Client(addr) as client:
                out = await client.complete("hello", request_id="r")
        finally:
            await stop()
        assert out.token_ids == [5, 6, 7]
        assert d.rpcs() == ["PrepareReceive", "PrepareReceive", "StartGeneration"]
        assert d.aborts == [("r", False)]  # p1 may still write: D must quarantine
        assert p1.rpcs() == ["RemoteSend"] and p2.rpcs() == ["RemoteSend"]
        assert d.calls[2][1].expect_kv_notification

    run(go())


def test_when_every_prefill_node_fails_the_decode_node_prefills_itself():
    async def go():
        p1 = FakeWorker("p1", fail={"RemoteSend": grpc.StatusCode.INVALID_ARGUMENT})
        p2 = FakeWorker("p2", fail={"RemoteSend": UNAVAILABLE})
        d = RecordingWorker("d")
        addr, _, stop = await start_router([p1, p2], [d])
        try:
            async with Client(addr) as client:
                out = await client.complete("hello world", request_id="r")
        finally:
            await stop()
        assert out.token_ids == [5, 6, 7] and out.finish_reason == "length"
        prepares = [req for name, req in d.calls if name == "PrepareReceive"]
        assert [p.kv_window_end for p in prepares] == [-1, len("hello world") - 1, 0]
        # p1 answered INVALID_ARGUMENT itself (nothing written): settled; p2 may still write.
        assert d.aborts == [("r", True), ("r", False)]
        start = d.calls[-1][1]
        assert start.kv_window_begin == 0 and not start.expect_kv_notification
        route = out.usage["route"]
        assert route["remote_send_skipped"] and route["prefill_endpoint"] == ""

    run(go())


def test_unavailable_decode_node_is_skipped_and_marked_down():
    async def go():
        d1 = FakeWorker("d1", matched=100, fail={"PrepareReceive": UNAVAILABLE})
        d2 = FakeWorker("d2", matched=100)
        addr, dispatcher, stop = await start_router([], [d1, d2])
        try:
            async with Client(addr) as client:
                outs = [await client.complete("hi") for _ in range(4)]
            await asyncio.sleep(0.2)  # the health check (fake nodes have none) fails
            routable = {e.address: e.routable for e in dispatcher.registry.decode}
        finally:
            await stop()
        assert all(o.token_ids == [5, 6, 7] for o in outs)
        assert d1.rpcs().count("PrepareReceive") == 1  # tried once, then not routable
        assert d2.rpcs().count("StartGeneration") == 4
        assert sorted(routable.values()) == [False, True]

    run(go())


def test_past_the_queue_bound_requests_get_resource_exhausted():
    async def go():
        d = FakeWorker("d", matched=100, tokens=range(20), token_delay_s=0.05)
        addr, _, stop = await start_router([], [d], max_concurrent_requests=1, max_queued_requests=1)
        try:
            async with Client(addr) as client:
                running = asyncio.ensure_future(client.complete("a"))
                await asyncio.sleep(0.2)
                queued = asyncio.ensure_future(client.complete("b"))
                await asyncio.sleep(0.2)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client.complete("c")
                outs = [await running, await queued]
        finally:
            await stop()
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "router is full" in err.value.details()
        assert all(len(o.token_ids) == 20 for o in outs)

    run(go())

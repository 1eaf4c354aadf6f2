"""The router absorbs node failures the client need not see, against fake workers:
another prefill node, then the decode node prefilling itself; another decode node; and a
bounded queue (RESOURCE_EXHAUSTED past it)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.client import AsyncClient
from tests.router.fake_worker import FakeWorker, one_request, reached, run, start_router

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


class RecordingWorker(FakeWorker):
    """Also records whether each Abort said no write could still come."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.aborts: list[tuple[str, bool]] = []
        self.aborted = asyncio.Event()  # set by the first Abort

    async def Abort(self, request, context):
        self.aborts.append((request.request_id, request.kv_write_settled))
        self.aborted.set()
        return await super().Abort(request, context)


def test_failed_remote_send_is_retried_on_another_prefill_node_with_a_fresh_reservation():
    async def go():
        p1, p2 = FakeWorker("p1", fail={"RemoteSend": UNAVAILABLE}), FakeWorker("p2")
        d = RecordingWorker("d")
        addr, _, stop = await start_router([p1, p2], [d])
        try:
            async with AsyncClient(addr) as client:
                out = await client.generate("hello", request_id="r")
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
            async with AsyncClient(addr) as client:
                out = await client.generate("hello world", request_id="r")
        finally:
            await stop()
        assert out.token_ids == [5, 6, 7] and out.finish_reason == "length"
        prepares = [req for name, req in d.calls if name == "PrepareReceive"]
        assert [p.kv_window_end for p in prepares] == [-1, len("hello world") - 1, 0]
        # p1 answered INVALID_ARGUMENT itself (nothing written): settled; p2 may still write.
        assert d.aborts == [("r", True), ("r", False)]
        start = d.calls[-1][1]
        assert start.kv_window_begin == 0 and not start.expect_kv_notification
        route = out.usage.route
        assert route.remote_send_skipped and route.prefill_endpoint == ""

    run(go())


def test_unavailable_decode_node_is_skipped_and_marked_down():
    async def go():
        d1 = FakeWorker("d1", matched=100, fail={"PrepareReceive": UNAVAILABLE})
        d2 = FakeWorker("d2", matched=100)
        addr, dispatcher, stop = await start_router([], [d1, d2])
        try:
            async with AsyncClient(addr) as client:
                outs = [await client.generate("hi") for _ in range(4)]
            decodes = dispatcher.registry.decode
            await reached(lambda: not all(e.routable for e in decodes),
                          "a failed health check (fake nodes have none)")
            routable = {e.address: e.routable for e in decodes}
        finally:
            await stop()
        assert all(o.token_ids == [5, 6, 7] for o in outs)
        assert d1.rpcs().count("PrepareReceive") == 1  # tried once, then not routable
        assert d2.rpcs().count("StartGeneration") == 4
        assert sorted(routable.values()) == [False, True]

    run(go())


def test_past_the_queue_bound_requests_get_resource_exhausted():
    async def go():
        d = FakeWorker("d", matched=100, tokens=range(20))
        d.stream_gate = asyncio.Event()  # "a" holds the one slot until "c" is refused
        addr, dispatcher, stop = await start_router([], [d], max_concurrent_requests=1,
                                                    max_queued_requests=1)
        held = dispatcher.admission.active
        try:
            async with AsyncClient(addr) as client:
                running = asyncio.ensure_future(client.generate("a"))
                await reached(lambda: len(held) == 1, "the first request running")
                queued = asyncio.ensure_future(client.generate("b"))
                await reached(lambda: len(held) == 2, "the second request queued")
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client.generate("c")
                d.stream_gate.set()
                outs = [await running, await queued]
        finally:
            await stop()
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "router is full" in err.value.details()
        assert all(len(o.token_ids) == 20 for o in outs)

    run(go())


class FailsFirstPrepare(RecordingWorker):
    """Fails its first PrepareReceive with `code`, then reserves normally."""

    def __init__(self, *args, code, **kwargs):
        super().__init__(*args, **kwargs)
        self.code = code

    async def PrepareReceive(self, request, context):
        if self.code is not None:
            code, self.code = self.code, None
            self.calls.append(("PrepareReceive", request))
            await context.abort(code, "PrepareReceive failed on purpose")
        return await super().PrepareReceive(request, context)


def test_a_full_decode_node_gets_no_abort_and_a_node_that_may_have_reserved_no_retry():
    """RESOURCE_EXHAUSTED is D's own answer (nothing reserved): no Abort, and the retry
    may go to the same node. DEADLINE_EXCEEDED leaves it unknown whether D reserved: D is
    aborted and this request reserves on it no more, so that Abort, landing late, cannot
    free a newer reservation that a prefill node is writing."""
    async def go():
        full = FailsFirstPrepare("full", matched=100, code=grpc.StatusCode.RESOURCE_EXHAUSTED)
        out = await one_request([FakeWorker("p")], [full], "r1", full_retry_s=5)
        assert out.token_ids == [5, 6, 7]
        assert full.rpcs() == ["PrepareReceive", "PrepareReceive", "StartGeneration"]
        assert full.aborts == []

        # d1 may have reserved; d2 is full once. The retry round must skip d1 although
        # it passes its health check (the failure was only slow).
        d1 = FailsFirstPrepare("d1", matched=100, code=grpc.StatusCode.DEADLINE_EXCEEDED)
        d2 = FailsFirstPrepare("d2", matched=100, code=grpc.StatusCode.RESOURCE_EXHAUSTED)
        d1.healthy = True
        out = await one_request([FakeWorker("p")], [d1, d2], "r2", until=d1.aborted.wait(),
                                full_retry_s=5)
        assert out.token_ids == [5, 6, 7]
        assert d1.rpcs() == ["PrepareReceive"] and d1.aborts == [("r2", True)]
        assert d2.rpcs() == ["PrepareReceive", "PrepareReceive", "StartGeneration"]
        assert d2.aborts == []

    run(go())


class LeaseEndsFirst(RecordingWorker):
    """Its first StartGeneration finds the lease ended (NOT_FOUND), as when the call reaches
    the decode node just after the lease's end."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ended = False

    async def StartGeneration(self, request, context):
        if not self.ended:
            self.ended = True
            self.calls.append(("StartGeneration", request))
            await context.abort(grpc.StatusCode.NOT_FOUND, "no reservation for request 'r'")
        async for msg in super().StartGeneration(request, context):
            yield msg


def test_a_lease_that_ended_before_start_generation_lets_the_decode_node_prefill_itself():
    async def go():
        d = LeaseEndsFirst("d")
        out = await one_request([FakeWorker("p")], [d], "r")
        assert out.token_ids == [5, 6, 7]
        # The fake records the local prepare riding in the second StartGeneration first.
        assert d.rpcs() == ["PrepareReceive", "StartGeneration", "PrepareReceive",
                            "StartGeneration"]
        retry = d.calls[-1][1]
        assert retry.HasField("prepare") and retry.prepare.local_prefill
        assert out.usage.route.skip_reason == "lease_ended"

    run(go())

"""The router's three-step dispatch against fake workers (no model, no NIXL)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.client import AsyncClient
from tests.router.fake_worker import FakeWorker, start_router, run


def test_calls_prepare_then_remote_send_then_start_and_streams_back():
    async def go():
        p, d = FakeWorker("p"), FakeWorker("d", matched=2)
        addr, _, stop = await start_router([p], [d])
        try:
            async with AsyncClient(addr) as client:
                msgs = [m async for m in client.responses("hello", request_id="r1", temperature=0.0)]
        finally:
            await stop()
        assert d.rpcs() == ["PrepareReceive", "StartGeneration"]
        assert p.rpcs() == ["RemoteSend"]
        prep, send, start = d.calls[0][1], p.calls[0][1], d.calls[1][1]
        assert list(prep.prompt_token_ids) == [ord(c) for c in "hello"]
        assert prep.kv_window_end == -1 and prep.sampling.temperature == 0.0
        assert (send.kv_window_begin, send.kv_window_end) == (2, 4)
        assert send.lease_id == "lease-1" and send.decode_agent_name == "agent-d"
        assert send.decode_address.startswith("127.0.0.1:")
        assert start.kv_window_begin == 4 and start.expect_kv_notification
        assert [list(m.token_ids) for m in msgs[:-1]] == [[5], [6], [7]]
        assert msgs[-2].finish_reason == "length"
        usage = msgs[-1].usage
        assert msgs[-1].HasField("usage") and usage.total_tokens == 7
        assert usage.time_to_first_token_s > 0
        assert (usage.route.kv_window_begin, usage.route.kv_window_end) == (2, 4)
        assert usage.route.prefill_endpoint and not usage.route.remote_send_skipped
        assert p.aborted == [] and d.aborted == []

    run(go())


def test_remote_send_skipped_when_decode_holds_the_whole_window():
    async def go():
        p, d = FakeWorker("p"), FakeWorker("d", matched=100)
        addr, _, stop = await start_router([p], [d])
        try:
            async with AsyncClient(addr) as client:
                out = await client.generate("hello")
        finally:
            await stop()
        assert p.rpcs() == []
        assert d.calls[1][1].expect_kv_notification is False
        assert out.usage.route.remote_send_skipped is True
        assert out.token_ids == [5, 6, 7]

    run(go())


def test_per_request_kv_window_end_reaches_the_decode_node():
    async def go():
        p, d = FakeWorker("p"), FakeWorker("d")
        addr, _, stop = await start_router([p], [d], kv_window_end=-1)
        try:
            async with AsyncClient(addr) as client:
                await client.generate("hello world", kv_window_end=-3)
        finally:
            await stop()
        assert d.calls[0][1].kv_window_end == -3
        assert p.calls[0][1].kv_window_end == len("hello world") - 3

    run(go())


def test_client_disconnect_aborts_on_the_decode_node():
    async def go():
        p, d = FakeWorker("p"), FakeWorker("d", tokens=range(100), token_delay_s=0.05)
        addr, dispatcher, stop = await start_router([p], [d])
        try:
            async with AsyncClient(addr) as client:
                async for msg in client.responses("hello", request_id="gone"):
                    break  # disconnect after the first token
            for _ in range(100):
                if d.aborted:
                    break
                await asyncio.sleep(0.02)
        finally:
            await stop()
        assert d.aborted == ["gone"]
        assert ("default", "gone") not in dispatcher.active

    run(go())


def test_abort_during_remote_send_reaches_prefill_and_decode():
    async def go():
        p, d = FakeWorker("p"), FakeWorker("d")
        p.remote_send_gate = asyncio.Event()
        addr, _, stop = await start_router([p], [d])
        try:
            async with AsyncClient(addr) as client:
                task = asyncio.ensure_future(client.generate("hello", request_id="x"))
                while p.rpcs() != ["RemoteSend"]:
                    await asyncio.sleep(0.01)
                assert await client.abort("x") is True
                p.remote_send_gate.set()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await task
                assert err.value.code() == grpc.StatusCode.CANCELLED
        finally:
            await stop()
        assert "x" in p.aborted and "x" in d.aborted
        assert "StartGeneration" not in d.rpcs()

    run(go())


def test_decode_failure_is_unavailable_naming_the_node_in_the_log_only(caplog):
    caplog.set_level("INFO", logger="pdserve.router")

    async def go():
        p, d = FakeWorker("p"), FakeWorker("d", fail={"StartGeneration": grpc.StatusCode.UNAVAILABLE})
        addr, _, stop = await start_router([p], [d])
        try:
            async with AsyncClient(addr) as client:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client.generate("hello", request_id="gone-1")
        finally:
            await stop()
        return err.value

    err = run(go())
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert "retry" in err.details() and "gone-1" in err.details(), err.details()
    assert "127.0.0.1" not in err.details() and "StartGeneration" not in err.details()
    assert any("gone-1" in r.getMessage() and "StartGeneration on decode node 127.0.0.1:"
               in r.getMessage() for r in caplog.records), caplog.text


def test_bad_prompt_is_invalid_argument():
    async def go():
        addr, _, stop = await start_router([FakeWorker("p")], [FakeWorker("d")])
        try:
            async with AsyncClient(addr) as client:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client.generate("")
        finally:
            await stop()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "empty" in err.value.details()

    run(go())


def test_round_robin_spreads_over_decode_nodes():
    async def go():
        d1, d2 = FakeWorker("d1", matched=100), FakeWorker("d2", matched=100)
        addr, _, stop = await start_router([], [d1, d2])
        try:
            async with AsyncClient(addr) as client:
                for _ in range(4):
                    await client.generate("hi")
        finally:
            await stop()
        assert d1.rpcs().count("StartGeneration") == 2 == d2.rpcs().count("StartGeneration")

    run(go())


class _LateRemoteSend(FakeWorker):
    """A prefill node that sees the router's Abort before its overlapped RemoteSend: the two
    calls race, and here the abort always wins."""

    def __init__(self, name):
        super().__init__(name)
        self.abort_seen = asyncio.Event()

    async def Abort(self, request, context):
        response = await super().Abort(request, context)
        self.abort_seen.set()
        return response

    async def RemoteSend(self, request, context):
        await self.abort_seen.wait()
        return await super().RemoteSend(request, context)


def test_a_refused_reservation_ends_an_overlapped_remote_send_the_abort_overtook():
    # D refuses the reservation; the router aborts the early RemoteSend on P, which arrives
    # after the abort and would wait for a window that never comes (10 s in the fake). The
    # client hears D's refusal at once instead of when the RemoteSend gives up.
    async def go():
        p = _LateRemoteSend("p")
        d = FakeWorker("d", fail={"PrepareReceive": grpc.StatusCode.INVALID_ARGUMENT})
        addr, _, stop = await start_router([p], [d])
        try:
            async with AsyncClient(addr) as client:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client.generate("hello", timeout=5)
        finally:
            await stop()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert p.aborted and not p.windows

    run(go())


def test_the_prefill_is_sent_ahead_only_where_the_decode_node_has_room():
    """Overlap is for a reservation that will not wait: a request that will wait in the
    decode node's line for pages gets its prefill only once it holds them."""
    from pdserve.router.dispatch import _room_for
    from pdserve.router.registry import Endpoint
    from pdserve.runtime.identity import NodeIdentity

    d = Endpoint("d:1", "decode", identity=NodeIdentity("m", "h", "float32", 2, 2, 16, 8),
                 free_pages=12, total_pages=40)
    assert _room_for(d, 96)        # 12 pages
    assert not _room_for(d, 97)    # 13 pages, 12 free
    d.total_pages = 0
    assert _room_for(d, 1000)      # no load report yet: nothing known, overlap as before
    assert _room_for(None, 1000)


def _saturate(dispatcher, backlog: int) -> None:
    """Every prefill node saturated (sends take 20 s, work queued); the decode node has
    `backlog` prompt tokens to prefill at 5 ms each beside its streams."""
    from pdserve.proto import pdserve_pb2

    for p in dispatcher.registry.prefill:
        p.send_latency_s, p.reported_queue = 20.0, 4
    for d in dispatcher.registry.decode:
        d.steps = pdserve_pb2.LoadReport(num_decoding=2, prompt_backlog_tokens=backlog,
                                         decode_step_ms=50, prompt_token_ms=5, itl_target_ms=125)


@pytest.mark.parametrize("policy", ["steady", "throughput"])
def test_when_every_side_is_saturated_steady_waits_and_throughput_sends_to_decode(policy):
    async def go():
        p, d = FakeWorker("p"), FakeWorker("d")
        addr, dispatcher, stop = await start_router([p], [d], disagg_policy=policy,
                                                    load_interval_s=0.02)
        _saturate(dispatcher, backlog=10_000)  # D would need 83 s: more than P's 20 s
        planned, replanned = dispatcher._plan, asyncio.Event()
        plans = []

        def counting(*args):
            plans.append(planned(*args))
            # steady: planned again twice, so it is waiting, whatever the pace
            if len(plans) >= (3 if policy == "steady" else 1):
                replanned.set()
            return plans[-1]

        dispatcher._plan = counting
        try:
            async with AsyncClient(addr) as client:
                call = asyncio.ensure_future(client.generate("hello", request_id="r1"))
                await asyncio.wait_for(replanned.wait(), 60)
                calls_while_saturated = d.rpcs() + p.rpcs()
                dispatcher.registry.prefill[0].reported_queue = 0  # P's queue drained
                await call
        finally:
            await stop()
        if policy == "steady":
            assert calls_while_saturated == []  # it waited at the router, on no node
            assert all(plan.wait for plan in plans[:3])
            assert p.rpcs() == ["RemoteSend"]
        else:
            assert d.calls[0][1].local_prefill and p.rpcs() == []

    run(go())

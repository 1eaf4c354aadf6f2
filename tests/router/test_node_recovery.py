"""A prefill node stopped (SIGSTOP: its connections stay up, it answers nothing) and resumed,
issue 38: the router waits on it no longer than the lease; when it passes its health check
again, calls still in flight to it run to their own end on the old channel; and a node call
cancelled under a request ends it with a status at once, never with silence until the
client's deadline."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.client import AsyncClient
from pdserve.router.registry import Endpoint, WorkerRegistry
from tests.router.fake_worker import FakeWorker, reached, run, start_router

CLIENT_DEADLINE_S = 10.0  # a request left with no status waits this long


class LongLease(FakeWorker):
    """Grants 30 s leases, so the RemoteSend held here is bounded by nothing in the test."""

    async def PrepareReceive(self, request, context):
        reply = await super().PrepareReceive(request, context)
        reply.lease_ms = 30_000
        return reply


class Stopped(FakeWorker):
    """Takes every call and answers none: a stopped process behind a live connection."""

    async def DeliverWindow(self, request, context):
        await asyncio.Event().wait()


def test_an_early_send_to_a_stopped_prefill_node_is_given_up_when_the_lease_ends():
    """The window's DeliverWindow waits no longer than the lease (1 s here), not its own
    bound (60 s here, past the client's deadline): D then prefills the prompt itself."""
    async def go():
        addr, _, stop = await start_router([Stopped("p")], [FakeWorker("d")],
                                           prepare_timeout_s=60.0)
        try:
            async with AsyncClient(addr) as client:
                return await client.generate("hello", request_id="r", timeout=CLIENT_DEADLINE_S)
        finally:
            await stop()

    out = run(go())
    assert out.token_ids == [5, 6, 7] and out.usage.route.skip_reason == "fallback", out.usage


async def _held_send(overlap: bool, recover):
    """A request whose RemoteSend is held on p while `recover(registry, p's endpoint)` runs,
    then let go: the client's answer, or the error it got."""
    p, d = FakeWorker("p"), LongLease("d")
    p.healthy, p.remote_send_gate = True, asyncio.Event()
    addr, dispatcher, stop = await start_router([p], [d], overlap_prefill=overlap)
    try:
        async with AsyncClient(addr) as client:
            answer = asyncio.ensure_future(client.generate(
                "hello", request_id="r", timeout=CLIENT_DEADLINE_S))
            await reached(lambda: "RemoteSend" in p.rpcs(), "the RemoteSend held on p")
            await recover(dispatcher.registry, dispatcher.registry.prefill[0])
            p.remote_send_gate.set()
            try:
                return await answer
            except grpc.aio.AioRpcError as err:
                return err
    finally:
        await stop()


@pytest.mark.parametrize("overlap", [True, False], ids=["early-send", "after-reserve"])
def test_a_call_in_flight_when_its_node_passes_its_health_check_again_is_answered(overlap):
    async def found_down_then_back(registry: WorkerRegistry, endpoint: Endpoint):
        endpoint.routable = False  # as after a health check that timed out (p was frozen)
        registry.report_failure(endpoint, "RemoteSend outlived its lease")
        await reached(lambda: endpoint.routable, "p passing its health check again")

    out = run(_held_send(overlap, found_down_then_back))
    assert not isinstance(out, Exception), out
    assert out.token_ids == [5, 6, 7] and not out.usage.route.remote_send_skipped


def test_a_node_call_cancelled_under_a_request_ends_it_unavailable_at_once():
    async def channel_closed(registry: WorkerRegistry, endpoint: Endpoint):
        await endpoint.close()  # cancels the RemoteSend in flight on it

    err = run(_held_send(False, channel_closed))
    assert isinstance(err, grpc.aio.AioRpcError), err
    # Not DEADLINE_EXCEEDED: the router said what happened instead of falling silent.
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "retry" in err.details(), err

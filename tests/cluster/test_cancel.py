"""Cancel and abort at every phase of a disaggregated request; leases and deadlines.

After each, every node's pool is full again with nothing parked or quarantined.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.client import AsyncClient
from pdserve.proto import pdserve_pb2
from pdserve.runtime.server import channel
from tests.cluster.conftest import HELD, SLOW
from tests.cluster.nodes import (GREEDY, full, gate_open, load, open_gates, run, stopped_at,
                                 wait_for, wait_pools_full, worker_stub)

PROMPT = "the quick brown fox jumps over the lazy dog " * 3


async def _idle(address: str) -> bool:
    return (await load(address)).num_running == 0


async def _parked(cluster) -> int:
    return sum([(await load(cluster.address(d))).num_parked for d in ("d1", "d2")])


@pytest.mark.parametrize("phase,how,router", [
    # A client gone during the prefill: the window may or may not have reached the prefill
    # node (the router cancels its DeliverWindow too), so D may have to wait for the lease
    # (router `short`: 2 s) plus the grace period before it can trust the pages again.
    ("prefill", "disconnect", "short"),
    # An abort during the transfer: the write lands and D sees its notification.
    ("kv_write", "abort", "main"),
], ids=["prefill-in-progress", "transfer-in-flight"])
def test_cancel_during_remote_send_frees_pages_on_every_node(fault_cluster, phase, how, router):
    c = fault_cluster
    request_id = f"{SLOW}{phase}-{how}"

    async def go():
        if phase == "kv_write":  # it passes the prefill on its way there
            await open_gates(c, "prefill", request_id)
        async with AsyncClient(c.address(router)) as client:
            task = asyncio.ensure_future(client.generate(PROMPT, request_id=request_id,
                                                         max_tokens=300, **GREEDY))
            prefill = await stopped_at(c, phase, request_id)
            busy = (await load(c.address(prefill))).num_running
            parked = await wait_for(lambda: _parked(c), timeout_s=10)
            if how == "abort":
                assert await client.abort(request_id) is True
            else:
                task.cancel()  # the client disconnects
            if phase == "prefill":
                # The router's cancel must reach P while the gate holds it there: a prefill
                # let through first would go on to its write (and wait at that gate for good).
                await wait_for(lambda: _idle(c.address(prefill)), timeout_s=10)
            else:
                await gate_open(c.address(prefill), phase, request_id)
            with pytest.raises((grpc.aio.AioRpcError, asyncio.CancelledError)) as err:
                await task
            if how == "abort":
                assert err.value.code() == grpc.StatusCode.CANCELLED
        return busy, parked, await wait_pools_full(c.workers)

    busy, parked, reports = run(go())
    assert busy == 1 and parked == 1  # P working on it, D holding the parked reservation
    assert all(full(r) for r in reports), reports


@pytest.mark.parametrize("how", ["disconnect", "abort"])
def test_cancel_while_decoding_frees_pages_on_every_node(fault_cluster, how):
    """The decode node holds a `held-` request's stream at its gate after the first token,
    so the cancel lands mid-generation however slow this machine is (the tiny model could
    otherwise finish its 400 tokens before a starved client cancels)."""
    request_id = f"{HELD}decoding-{how}"

    async def go():
        async with AsyncClient(fault_cluster.address("main")) as client:
            stream = client.responses(PROMPT, request_id=request_id, max_tokens=400, **GREEDY)
            async for msg in stream:
                assert msg.token_ids
                break
            node = await stopped_at(fault_cluster, "stream", request_id, ("d1", "d2"))
            running = (await load(fault_cluster.address(node))).num_running
            if how == "abort":
                assert await client.abort(request_id)
            await stream.aclose()
            await gate_open(fault_cluster.address(node), "stream", request_id)
        return running, await wait_pools_full(fault_cluster.workers)

    running, reports = run(go())
    assert running == 1
    assert all(full(r) for r in reports), reports


def test_parked_reservation_abort_and_lease_expiry_on_the_worker_api(fault_cluster):
    """Worker API straight: a settled Abort frees at once; an unsettled one and an expired
    lease quarantine the pages until lease + grace; late calls get clear statuses."""
    d1 = fault_cluster.address("d1")
    p1 = fault_cluster.address("p1")
    ids = list(range(10, 60))

    async def prepare(ch, rid, lease_ms):
        return await worker_stub(ch).PrepareReceive(pdserve_pb2.PrepareReceiveRequest(
            request_id=rid, prompt_token_ids=ids, kv_window_end=-1, lease_ms=lease_ms),
            timeout=10)

    async def go():
        out = {}
        async with channel(d1) as ch, channel(p1) as pch:
            stub = worker_stub(ch)
            await prepare(ch, "parked-settled", 60_000)
            out["held"] = await load(d1)
            await stub.Abort(pdserve_pb2.AbortRequest(request_id="parked-settled",
                                                      kv_write_settled=True), timeout=5)
            out["after_settled"] = await load(d1)

            await prepare(ch, "parked-unsettled", 500)
            await stub.Abort(pdserve_pb2.AbortRequest(request_id="parked-unsettled"), timeout=5)
            out["quarantined"] = await load(d1)

            prep = await prepare(ch, "expiring", 300)

            async def expired():  # the lease ends; its pages stay quarantined
                report = await load(d1)
                return report if report.num_quarantined == 2 else None

            out["expired"] = await wait_for(expired, timeout_s=5)
            with pytest.raises(grpc.aio.AioRpcError) as late_start:
                async for _ in stub.StartGeneration(pdserve_pb2.StartGenerationRequest(
                        request_id="expiring", kv_window_begin=prep.kv_window_end,
                        lease_id=prep.lease_id), timeout=5):
                    pass
            out["late_start"] = late_start.value
            with pytest.raises(grpc.aio.AioRpcError) as late_send:
                await worker_stub(pch).RemoteSend(pdserve_pb2.RemoteSendRequest(
                    request_id="expiring", prompt_token_ids=ids, kv_window_begin=0,
                    kv_window_end=prep.kv_window_end, kv_append_metadata=prep.kv_append_metadata,
                    lease_id=prep.lease_id, decode_agent_name=prep.decode_agent_name,
                    decode_address=d1, lease_remaining_ms=0),  # as a late router measures it
                    timeout=10)
            out["late_send"] = late_send.value
        out["final"] = await wait_pools_full([d1, p1])  # held to lease + grace: no writer named
        return out

    out = run(go())
    assert out["held"].num_parked == 1 and out["held"].free_pages < out["held"].total_pages
    assert full(out["after_settled"]), out["after_settled"]
    assert out["quarantined"].num_quarantined == 1 and out["quarantined"].num_parked == 0
    assert out["expired"].num_quarantined == 2 and out["expired"].leases_expired_total >= 1
    assert out["late_start"].code() == grpc.StatusCode.NOT_FOUND
    assert "expiring" in out["late_start"].details()
    assert out["late_send"].code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "lease" in out["late_send"].details() and "nothing was written" in out["late_send"].details()
    assert all(full(r) for r in out["final"]), out["final"]


def test_client_deadline_is_honoured_and_frees_pages(fault_cluster):
    async def go():
        async with AsyncClient(fault_cluster.address("main")) as client:
            # Held at the prefill node's gate for good: only the deadline can end it.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.generate(PROMPT, request_id=f"{SLOW}deadline", timeout=1.0,
                                      max_tokens=8, **GREEDY)
        return err.value, await wait_pools_full(fault_cluster.workers)

    err, reports = run(go())
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert all(full(r) for r in reports), reports

"""Cancel and abort at every phase of a disaggregated request; leases and deadlines.

After each, every node's pool is full again with nothing parked or quarantined.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from pdserve.client import Client
from pdserve.server import channel
from proto import pdserve_pb2
from tests.faults.cluster import (GRACE_MS, GREEDY, PHASE_DELAY_S, SLOW, full, load,
                                  wait_for, wait_pools_full, worker_stub)
from tests.faults.conftest import run

PROMPT = "the quick brown fox jumps over the lazy dog " * 3


async def _busy_prefill(cluster) -> list[str]:
    reports = [(n, await load(cluster.address(n))) for n in ("p1", "p2")]
    return [n for n, r in reports if r.num_running]


async def _cancel_in_phase(cluster, request_id: str, wait_s: float, how: str):
    async with Client(cluster.address("main")) as client:
        task = asyncio.ensure_future(client.complete(PROMPT, request_id=request_id,
                                                     max_tokens=300, **GREEDY))
        t0 = time.monotonic()
        busy = await wait_for(lambda: _busy_prefill(cluster), timeout_s=10)
        decode_parked = sum([(await load(cluster.address(d))).num_parked for d in ("d1", "d2")])
        await asyncio.sleep(max(0.0, wait_s - (time.monotonic() - t0)))
        if how == "abort":
            assert await client.abort(request_id) is True
        else:
            task.cancel()  # the client disconnects
        with pytest.raises((grpc.aio.AioRpcError, asyncio.CancelledError)) as err:
            await task
        if how == "abort":
            assert err.value.code() == grpc.StatusCode.CANCELLED
    return busy, decode_parked


@pytest.mark.parametrize("phase,wait_s,how", [
    ("prefill", 0.3 * PHASE_DELAY_S, "disconnect"),
    ("transfer", 1.4 * PHASE_DELAY_S, "abort"),
], ids=["prefill-in-progress", "transfer-in-flight"])
def test_cancel_during_remote_send_frees_pages_on_every_node(fault_cluster, phase, wait_s, how):
    async def go():
        busy, parked = await _cancel_in_phase(fault_cluster, f"{SLOW}{phase}-{how}", wait_s, how)
        # The prefill node stops before writing (it tells D so) or finishes its write (D
        # sees the notification): either way D's quarantine ends well before lease + grace.
        t0 = time.monotonic()
        reports = await wait_pools_full(fault_cluster.workers, timeout_s=6)
        return busy, parked, reports, time.monotonic() - t0

    busy, parked, reports, took = run(go())
    assert len(busy) == 1 and parked == 1  # P working, D holding the parked reservation
    assert all(full(r) for r in reports), reports
    assert took < GRACE_MS / 1000, f"pages came back only after {took:.1f}s"


@pytest.mark.parametrize("how", ["disconnect", "abort"])
def test_cancel_while_decoding_frees_pages_on_every_node(fault_cluster, how):
    async def go():
        async with Client(fault_cluster.address("main")) as client:
            stream = client.stream(PROMPT, request_id=f"decoding-{how}", max_tokens=400, **GREEDY)
            got = []
            async for msg in stream:
                got += msg.token_ids
                if len(got) >= 3:
                    break
            running = sum([(await load(fault_cluster.address(d))).num_running
                           for d in ("d1", "d2")])
            if how == "abort":
                assert await client.abort(f"decoding-{how}") is True
            await stream.aclose()
        return running, await wait_pools_full(fault_cluster.workers, timeout_s=6)

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
            await asyncio.sleep(0.6)  # the lease ends; its pages stay quarantined
            out["expired"] = await load(d1)
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
                    decode_address=d1, lease_expires_unix_ms=prep.lease_expires_unix_ms),
                    timeout=10)
            out["late_send"] = late_send.value
        out["final"] = await wait_pools_full([d1, p1], timeout_s=GRACE_MS / 1000 + 5)
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
        async with Client(fault_cluster.address("main")) as client:
            t0 = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.complete(PROMPT, request_id=f"{SLOW}deadline", timeout=1.0,
                                      max_tokens=8, **GREEDY)
            took = time.monotonic() - t0
        return err.value, took, await wait_pools_full(fault_cluster.workers, timeout_s=8)

    err, took, reports = run(go())
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert took < 2.0
    assert all(full(r) for r in reports), reports

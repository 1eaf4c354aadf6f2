"""The router's retry and fallback counters, over fake workers in-process: a failed
RemoteSend retried on the other prefill node counts one retry; when both fail, the decode
node prefilling the prompt itself counts one fallback."""

from __future__ import annotations

import grpc
from prometheus_client import REGISTRY

from pdserve.client import AsyncClient
from tests.router.fake_worker import FakeWorker
from tests.router.fake_worker import start_router, run


def value(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def counters() -> tuple[float, float, float]:
    return (value("pdserve_router_retries_total", call="RemoteSend"),
            value("pdserve_router_fallbacks_total", reason="decode_prefill"),
            value("pdserve_requests_total", role="router", outcome="length"))


def _serve(prefill_fails: list[bool]) -> tuple[float, float, float]:
    async def go():
        unavailable = {"RemoteSend": grpc.StatusCode.UNAVAILABLE}
        prefill = [FakeWorker(f"p{i}", fail=unavailable if f else None)
                   for i, f in enumerate(prefill_fails)]
        addr, _, stop = await start_router(prefill, [FakeWorker("d")])
        try:
            before = counters()
            async with AsyncClient(addr) as client:
                out = await client.generate("hello world")
            assert out.finish_reason == "length"
            return tuple(a - b for a, b in zip(counters(), before))
        finally:
            await stop()

    return run(go())


def test_a_retried_remote_send_counts_one_retry_and_no_fallback():
    assert _serve([True, False]) == (1, 0, 1)


def test_decode_prefilling_after_every_prefill_failed_counts_one_fallback():
    assert _serve([True, True]) == (1, 1, 1)

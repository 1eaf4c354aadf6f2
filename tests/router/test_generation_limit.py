"""`--generation-timeout-s` against fake workers: a generation that has produced no token
when the limit passes fails with DEADLINE_EXCEEDED naming the flag, is aborted on its
decode node, and does not count against that node (the cluster tests cover a limit that
ends a stream with tokens: tests/cluster/test_generation_limit.py)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.client import AsyncClient
from pdserve.router.config import RouterConfig
from tests.router.fake_worker import FakeWorker, reached, run, start_router


def test_no_limit_is_the_default():
    assert RouterConfig(model="m").generation_timeout_s == 0


def test_a_generation_with_no_token_by_the_limit_fails_naming_the_flag():
    async def go():
        p, d = FakeWorker("p"), FakeWorker("d")
        d.stream_gate = asyncio.Event()  # never set: D never sends a token
        addr, dispatcher, stop = await start_router([p], [d], generation_timeout_s=0.2)
        try:
            async with AsyncClient(addr) as client:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client.generate("hello", request_id="quiet-1", timeout=60)
            await reached(lambda: "quiet-1" in d.aborted, "the Abort (sent in the background) at D")
            return err.value, d.aborted, dispatcher.registry.decode[0].routable
        finally:
            await stop()

    err, aborted, routable = run(go())
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err
    assert "--generation-timeout-s (0.2 s)" in err.details() and "127.0.0.1" not in err.details()
    assert "quiet-1" in aborted
    assert routable  # the router's own limit is no sign that the node is gone

"""A router asking longer leases than its decode nodes grant refuses those nodes at once and
says why in its log, instead of routing every request into an INVALID_ARGUMENT; the nodes
and the cluster's other routers are untouched."""

from __future__ import annotations

import grpc
import pytest

from pdserve.client import AsyncClient
from tests.cluster.conftest import ROUTER_FLAGS
from tests.cluster.nodes import GREEDY, Cluster, run, wait_pools_full, wait_until

DECODE_MAX_LEASE_MS = 120_000  # the decode nodes' default --max-lease-ms


def test_decode_nodes_that_cannot_grant_the_routers_lease_are_refused(fault_cluster, tmp_path):
    c = fault_cluster
    extra = Cluster(tmp_path, c.model)
    try:
        router = extra.start("long", [
            "router", "--model", c.model, "--host", "127.0.0.1", "--prefill", c.address("p1"),
            "--decode", f"{c.address('d1')},{c.address('d2')}", "--lease-ms", "150000",
            *ROUTER_FLAGS])
        refusal = f"grants leases of at most {DECODE_MAX_LEASE_MS} ms"
        wait_until(lambda: extra.log_text("long").count(refusal) >= 2, "both decode nodes refused")

        async def ask():
            async with AsyncClient(router.address) as client:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client.generate("hello", max_tokens=2, timeout=10, **GREEDY)
            return err.value

        err = run(ask())
        assert err.code() == grpc.StatusCode.UNAVAILABLE, err
        log = extra.log_text("long")
        for node in ("d1", "d2"):
            assert f"refusing decode node {c.address(node)}" in log
        assert "this router asks for 150000 ms (--lease-ms)" in log
        assert "INVALID_ARGUMENT" not in log  # never sent a reservation it knew would fail
    finally:
        extra.stop()

    async def still_served():
        async with AsyncClient(c.address("main")) as client:
            text = await client.generate("after the refusal", max_tokens=3, timeout=30, **GREEDY)
        reports = await wait_pools_full([c.address(n) for n in ("p1", "p2", "d1", "d2")])
        return text, reports

    _, reports = run(still_served())
    assert all(r.free_pages == r.total_pages for r in reports)
    assert {r.max_lease_ms for r in reports if r.role == "decode"} == {DECODE_MAX_LEASE_MS}

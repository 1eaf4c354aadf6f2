"""Nodes whose wall clocks disagree by minutes still serve correctly, disaggregated.

The prefill node runs 60 s behind, one decode node 60 s ahead and the other 60 s behind
(libfaketime's preloaded library fakes their wall clock; their monotonic clocks, which
UCX and every lease check use, stay real). The cluster has a key, so each window's
capability is signed on one clock and checked on another. Every request must still have
its KV sent by the prefill node (no silent fallback to local prefill), and its output
must equal the decode node's own prefill of the same prompt.
"""

from __future__ import annotations

import os

import libfaketime
import pytest

from pdserve.client import AsyncClient
from pdserve.runtime import auth, cluster_key
from tests.cluster.nodes import GREEDY, WORKER_FLAGS, Cluster, full, run, wait_pools_full

KEY = "clock-skew-test-cluster-key-0123456789"


def skewed(offset: str) -> dict[str, str]:
    lib = os.path.join(os.path.dirname(libfaketime.__file__), "vendor", "libfaketime", "src")
    return {"LD_PRELOAD": os.path.join(lib, "libfaketime.so.1"), "FAKETIME": offset,
            "DONT_FAKE_MONOTONIC": "1", "FAKETIME_NO_CACHE": "1",
            "PDSERVE_CLUSTER_KEY": KEY}


@pytest.fixture(scope="module")
def skewed_cluster(tiny_model, tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("skew-logs"), tiny_model)
    try:
        common = ["--model", tiny_model, "--host", "127.0.0.1"]
        for name, role, offset in (("p", "prefill", "-60s"), ("d1", "decode", "+60s"),
                                   ("d2", "decode", "-60s")):
            c.start(name, [role, *common, *WORKER_FLAGS], wait=False, env=skewed(offset))
        c.wait("p", "d1", "d2")
        c.start("router", ["router", *common, "--prefill", c.address("p"),
                           "--decode", f"{c.address('d1')},{c.address('d2')}"],
                env={"PDSERVE_CLUSTER_KEY": KEY})
        yield c
    finally:
        c.stop()


@pytest.fixture
def as_router(tmp_path):
    """This test process calls the workers (GetLoad) with the cluster's router token."""
    key_file = tmp_path / "cluster.key"
    key_file.write_text(KEY)
    cluster_key.configure(cluster_key.ClusterKeyConfig(key_file=str(key_file)))
    auth.configure("router")
    yield
    cluster_key.configure(cluster_key.ClusterKeyConfig())
    auth.configure(None)


def test_minutes_of_clock_skew_change_neither_the_route_nor_the_answer(skewed_cluster,
                                                                       as_router):
    c = skewed_cluster
    prompts = [[(i * 23 + j * 3) % 480 + 20 for j in range(40 + 9 * i)] for i in range(6)]

    async def go():
        async with AsyncClient(c.address("router")) as client:
            outs = [await client.generate(p, max_tokens=8, **GREEDY) for p in prompts]
            local = [await client.generate(p, kv_window_end=0, max_tokens=8, **GREEDY)
                     for p in prompts]
        return outs, local, await wait_pools_full([c.address(n) for n in ("p", "d1", "d2")])

    outs, local, reports = run(go())
    routes = [o.usage.route for o in outs]
    assert not any(r.remote_send_skipped for r in routes), routes
    assert {r.decode_endpoint for r in routes} == {c.address("d1"), c.address("d2")}
    assert [o.token_ids for o in outs] == [o.token_ids for o in local]
    assert all(full(r) for r in reports), reports

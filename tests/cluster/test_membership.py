"""Nodes join and leave through etcd while the routers run; incompatible nodes are refused."""

from __future__ import annotations

from pdserve.client import AsyncClient
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.runtime.membership import new_client
from pdserve.runtime.server import channel
from tests.cluster.conftest import SCALE_TTL_S as TTL_S
from tests.cluster.nodes import run, wait_until
from tests.cluster.test_routing import GREEDY, prompt


async def _decode_names(c, router: str, n: int, seed: int) -> list[str]:
    async with AsyncClient(c.address(router)) as client:
        outs = [await client.generate(prompt(seed + i, 12), **GREEDY) for i in range(n)]
    return [c.name_of(o.usage.route.decode_endpoint) for o in outs]


async def _prefill_names(c, router: str, n: int, seed: int) -> list[str]:
    async with AsyncClient(c.address(router)) as client:
        outs = [await client.generate(prompt(seed + i, 12), **GREEDY) for i in range(n)]
    return [c.name_of(o.usage.route.prefill_endpoint) for o in outs]


async def _registered(c) -> set[str]:
    client = new_client(c.etcd)
    try:
        return {kv.key.decode().rsplit("/", 1)[-1] for kv in
                await client.get_prefix(b"/pdserve/workers/")}
    finally:
        await client.close()


def test_a_decode_node_that_joins_is_used_and_one_that_drains_leaves(scale_cluster):
    c = scale_cluster
    d3 = c.start_worker("d3")
    try:
        # Round robin over three decode nodes: d3 within three requests of being seen.
        names = run(_decode_names(c, "rr", 6, 400))
        assert "d3" in names, names

        async def drain():
            async with channel(d3.address) as ch:
                return await pdserve_pb2_grpc.WorkerStub(ch).Drain(pdserve_pb2.DrainRequest(),
                                                                   timeout=10)

        assert run(drain()).draining
        assert d3.proc.wait(30) == 0  # finished, deregistered and left by itself
        assert d3.address not in run(_registered(c))
        names = run(_decode_names(c, "rr", 6, 500))
        assert "d3" not in names and set(names) == {"d1", "d2"}, names
    finally:
        c.stop_node("d3")


def test_a_prefill_node_that_dies_disappears_when_its_lease_expires(scale_cluster):
    c = scale_cluster
    p3 = c.start_worker("p3")
    try:
        names = run(_prefill_names(c, "rr", 6, 600))
        assert "p3" in names, names
        p3.kill()
        # Until the lease ends a request may still try p3: it is retried elsewhere, and the
        # client never sees the failure.
        names = run(_prefill_names(c, "rr", 3, 700))
        assert "p3" not in names, names
        wait_until(lambda: p3.address not in run(_registered(c)),
                   "p3's registration to end with its lease", TTL_S + 5)
        names = run(_prefill_names(c, "rr", 4, 800))
        assert set(names) == {"p1", "p2"}, names
        assert "prefill node %s left" % p3.address in c.log_text("rr")
    finally:
        c.stop_node("p3")


def test_a_node_with_another_dtype_is_refused_with_a_message_naming_it(scale_cluster):
    c = scale_cluster
    d4 = c.start_worker("d4", "--dtype", "bfloat16")
    try:
        expected = f"refusing decode node {d4.address}"
        wait_until(lambda: expected in c.log_text("rr"), f"{expected!r} in the rr router's log")
        line = next(l for l in c.log_text("rr").splitlines() if expected in l)
        assert "dtype: float32 vs bfloat16" in line, line
        names = run(_decode_names(c, "rr", 4, 900))
        assert set(names) == {"d1", "d2"}, names
    finally:
        c.stop_node("d4")

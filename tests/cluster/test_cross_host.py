"""Router + prefill + decode on two hosts: prefill nodes in one network namespace, decode
node and routers in another, joined by a veth shaped to a slow rate (benchmarks/link.py),
and NIXL's UCX on TCP across it (nothing through shared memory: the veth's byte counters
show the KV crossing it).

Two prefill nodes: `--kv-send auto` (a decode node on another host gets layer-wise sends)
and `--kv-send whole`, each behind its own router. The link is slow on purpose (4 Mbit/s:
a 400-token window of the tiny model, 200 KB, takes ~0.4 s on it), so a test can act in
the middle of a window by watching the bytes arrive. Answers are compared with the
colocated node on loopback.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.benchmarks.link import Link
from pdserve.client import AsyncClient
from tests.cluster.nodes import (SKIPPED_UNDER_LOAD, WORKER_FLAGS, Cluster, full, load, run,
                                 wait_for, wait_pools_full)

RATE = "4mbit"
LEASE_MS, GRACE_MS = 3000, 1000
GREEDY = dict(temperature=0.0, ignore_eos=True, max_tokens=6)
PREFILL_FLAGS = ["--max-num-batched-tokens", "32"]  # many steps per window: layers leave early


def prompt(i: int, n: int = 400) -> list[int]:
    return [(i * 131 + k * 37) % 480 + 20 for k in range(n)]


class CrossHost(Cluster):
    def build(self, link: Link) -> None:
        self.link = link
        a, b = link.hosts
        common = ["--model", self.model, *WORKER_FLAGS]
        for name, mode in (("p-auto", "auto"), ("p-whole", "whole")):
            self.start(name, ["prefill", *common, *PREFILL_FLAGS, "--kv-send", mode, "--host", a.address,
                              "--log-format", "json"], wait=False, env=a.ucx_env(), netns=a.ns)
        self.start("d", ["decode", *common, "--host", b.address, "--quarantine-grace-ms", str(GRACE_MS)],
                   wait=False, env=b.ucx_env(), netns=b.ns)
        self.wait("p-auto", "p-whole", "d")
        for name, p in (("r-auto", "p-auto"), ("r-whole", "p-whole")):
            self.start(name, ["router", "--model", self.model, "--host", b.address, "--lease-ms", str(LEASE_MS),
                              "--prefill", self.address(p), "--decode", self.address("d")],
                       env=b.ucx_env(), netns=b.ns)

    def here(self, name: str) -> str:
        """The node's address as this (root-namespace) process reaches it: through a relay."""
        host = self.link.hosts[0 if name.startswith("p") else 1]
        return f"127.0.0.1:{self.link.forward(host, self.nodes[name].port)}"

    def received(self) -> int:
        """Bytes the decode host received over the link so far."""
        return self.link.hosts[1].counters()["rx_bytes"]

    def sends(self, node: str) -> list[dict]:
        lines = [json.loads(line) for line in self.log_text(node).splitlines() if line.startswith("{")]
        return [e for e in lines if e.get("role") == "prefill" and e.get("outcome") == "ok"]


@pytest.fixture(scope="module")
def hosts(tiny_model, tmp_path_factory):
    why = Link.unavailable()
    if why:
        pytest.skip(f"two hosts need network namespaces: {why}")
    with Link(RATE) as link:
        c = CrossHost(tmp_path_factory.mktemp("cross-host-logs"), tiny_model)
        try:
            c.build(link)
            yield c
        finally:
            c.stop()


async def answer(address: str, ids: list[int], **kw):
    async with AsyncClient(address, timeout=120) as client:
        return await client.generate(ids, **GREEDY, **kw)


@pytest.mark.parametrize("router", ["r-auto", "r-whole"])
def test_greedy_output_across_the_link_equals_the_colocated_engine(hosts, colocated, router):
    before = hosts.received()
    seed = 10 if router == "r-auto" else 20  # prompts of its own: nothing cached on the decode node
    prompts = [prompt(seed + i, n) for i, n in enumerate((5, 40, 160, 400))]

    async def go():
        return [(await answer(hosts.here(router), p), await answer(colocated.address, p)) for p in prompts]

    for ids, (disagg, coloc) in zip(prompts, run(go())):
        assert disagg.token_ids == coloc.token_ids, len(ids)
        route = disagg.usage.route  # a send past its 3 s lease is correct on a loaded machine
        assert not route.remote_send_skipped or route.skip_reason in SKIPPED_UNDER_LOAD, route
    if not route.remote_send_skipped:  # the 400-token window, whose sending is checked here
        assert hosts.received() - before > 400 * 512, "the KV did not cross the link"
        writes = [e["kv_writes"] for e in hosts.sends("p-auto" if router == "r-auto" else "p-whole")
                  if e["kv_window"].endswith(":399")]
        # Across hosts `auto` sends layer by layer: many writes for a window of 13 steps.
        assert writes and (min(writes) > 2 if router == "r-auto" else set(writes) == {1}), writes


def _in_the_middle(hosts, colocated: str, ids: list[int], kill: str | None):
    """Start `ids` on r-auto; once part of its window has crossed the link, start two other
    requests beside it, then cancel it (kill None) or SIGKILL node `kill`. Its outcome, the
    other two answers and their colocated ones, and the pools after."""
    async def go():
        others = [prompt(7, 120), prompt(8, 200)]
        expected = [(await answer(colocated, p)).token_ids for p in others]
        base = hosts.received()
        victim = asyncio.ensure_future(answer(hosts.here("r-auto"), ids))

        async def partly_across():
            return hosts.received() - base > 40_000
        await wait_for(partly_across, 30, poll_s=0.005)
        assert not victim.done()
        beside = [asyncio.ensure_future(answer(hosts.here("r-auto"), p)) for p in others]
        if kill is None:
            victim.cancel()
        else:
            hosts.kill(kill)
        outcome = (await asyncio.gather(victim, return_exceptions=True))[0]
        got = [g.token_ids for g in await asyncio.gather(*beside)]
        nodes = [n for n in ("p-auto", "p-whole", "d") if n != kill]
        pools = await wait_pools_full([hosts.here(n) for n in nodes])
        return outcome, got, expected, pools

    return run(go())


def test_a_cancel_in_the_middle_of_a_layer_wise_window_leaks_no_page_and_changes_no_other_answer(hosts, colocated):
    outcome, got, expected, pools = _in_the_middle(hosts, colocated.address, prompt(3, 480), kill=None)
    assert isinstance(outcome, asyncio.CancelledError)
    assert got == expected
    assert all(full(r) for r in pools), pools


def test_a_prefill_node_killed_in_the_middle_of_a_layer_wise_window_still_answers_right(hosts, colocated):
    ids = prompt(4, 480)
    try:
        outcome, got, expected, pools = _in_the_middle(hosts, colocated.address, ids, kill="p-auto")
        assert got == expected
        assert all(full(r) for r in pools), pools
        assert not isinstance(outcome, BaseException), outcome  # retried or prefilled by the decode node
        assert outcome.token_ids == run(answer(colocated.address, ids)).token_ids
        assert outcome.usage.route.prefill_endpoint == ""  # its one prefill node is gone
    finally:
        hosts.restart("p-auto")
    assert full(run(load(hosts.here("p-auto"))))

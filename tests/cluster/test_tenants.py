"""Two tenants on one real router + prefill + decode, the router's `--api-key-file` naming
them (`alice:KEY`, `bob:KEY`) and its dispatch slots few (2): issue 38's attacks between
tenants, refused.

- Abort with another tenant's request id answers NOT_FOUND, exactly as for an id never
  sent, and the victim's stream completes whole.
- The same request id sent by both tenants at once: both served, apart, each its own answer.
- One tenant's flood of queued requests does not hold the other's requests behind it:
  each of bob's waits for at most a couple of turns of alice's (counted), not for her queue.
"""

from __future__ import annotations

import asyncio
import secrets
import time

import grpc
import pytest

from pdserve.client import AsyncClient
from pdserve.procs import free_port
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.runtime.bearer import bearer_metadata
from tests.cluster.nodes import (GREEDY, WORKER_FLAGS, Cluster, gate_open, gate_reached, run,
                                 sample, scrape, wait_for)

KEYS = {"alice": "sk-alice-" + secrets.token_hex(8), "bob": "sk-bob-" + secrets.token_hex(8)}
HELD = "held-"  # the decode node holds these streams after their first token
SLOTS = 2


class TenantCluster(Cluster):
    def build(self) -> None:
        keys = self.logs / "api.keys"
        keys.write_text("# one line per tenant\n" + "".join(f"{t}:{k}\n" for t, k in KEYS.items()))
        common = ["--model", self.model, "--host", "127.0.0.1"]
        self.start("prefill", ["prefill", *common, *WORKER_FLAGS], wait=False)
        self.start("decode", ["decode", *common, *WORKER_FLAGS, "--test-gates", HELD],
                   wait=False)
        self.wait("prefill", "decode")
        self.http_port = free_port()
        self.start("router", ["router", *common, "--api-key-file", str(keys),
                              "--max-concurrent-requests", str(SLOTS),
                              "--http-port", str(self.http_port), "--prefill",
                              self.address("prefill"), "--decode", self.address("decode")])

    def client(self, tenant: str) -> AsyncClient:
        return AsyncClient(self.address("router"), api_key=KEYS[tenant])

    def in_router(self) -> float:
        """Requests the router holds, running or queued (its /metrics)."""
        samples = scrape(f"http://127.0.0.1:{self.http_port}/metrics")
        return sample(samples, "pdserve_queue_depth", role="router", queue="in_flight")


@pytest.fixture(scope="module")
def tenants(tiny_model, tmp_path_factory):
    cluster = TenantCluster(tmp_path_factory.mktemp("tenant-logs"), tiny_model)
    try:
        cluster.build()
        yield cluster
    finally:
        cluster.stop()


async def raw_abort(c: TenantCluster, tenant: str, request_id: str) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(c.address("router")) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pdserve_pb2_grpc.GenerationStub(ch).Abort(
                pdserve_pb2.AbortRequest(request_id=request_id),
                metadata=bearer_metadata(KEYS[tenant]), timeout=30)
    return err.value


def test_another_tenants_abort_is_not_found_and_the_victims_stream_completes(tenants):
    c = tenants
    victim = f"{HELD}victim"

    async def go():
        async with c.client("alice") as alice, c.client("bob") as bob:
            stream = alice.responses("a secret of alice's", request_id=victim, max_tokens=6,
                                     timeout=60, **GREEDY)
            first = await anext(stream)
            await gate_reached(c.address("decode"), "stream", f"{victim}@alice")
            attacks = [await raw_abort(c, "bob", victim), await raw_abort(c, "bob", "never-sent")]
            by_client = await bob.abort(victim)
            await gate_open(c.address("decode"), "stream", f"{victim}@alice")
            rest = [m async for m in stream]
        return attacks, by_client, [first, *rest]

    attacks, by_client, messages = run(go())
    assert [e.code() for e in attacks] == [grpc.StatusCode.NOT_FOUND] * 2
    # The same words for a live id of another tenant's as for one never sent: nothing shows.
    assert attacks[0].details().replace(victim, "ID") == \
        attacks[1].details().replace("never-sent", "ID")
    assert by_client is False
    tokens = [t for m in messages for t in m.token_ids]
    assert len(tokens) == 6 and [m.finish_reason for m in messages if m.finish_reason] == ["length"]


def test_the_same_request_id_from_two_tenants_at_once_is_served_apart(tenants):
    c = tenants
    rid = f"{HELD}shared-id"
    prompts = {"alice": "alice asks about apples", "bob": "bob asks about boats"}

    async def go():
        async with c.client("alice") as alice, c.client("bob") as bob:
            clients = {"alice": alice, "bob": bob}
            calls = {t: asyncio.ensure_future(clients[t].generate(
                prompts[t], request_id=rid, max_tokens=8, timeout=60, **GREEDY))
                for t in clients}
            for t in clients:  # both in flight at once, under one id each on the node
                await gate_reached(c.address("decode"), "stream", f"{rid}@{t}")
            for t in clients:
                await gate_open(c.address("decode"), "stream", f"{rid}@{t}")
            outs = {t: await call for t, call in calls.items()}
            alone = {t: await clients[t].generate(prompts[t], max_tokens=8, **GREEDY)
                     for t in clients}
        return outs, alone

    outs, alone = run(go())
    for t in ("alice", "bob"):
        assert outs[t].token_ids == alone[t].token_ids and len(outs[t].token_ids) == 8
    assert outs["alice"].token_ids != outs["bob"].token_ids  # two answers, not one twice


def test_one_tenants_flood_does_not_queue_the_others_requests_behind_it(tenants):
    """Alice queues 40 requests behind the 2 slots; then bob sends 3 short ones, one after
    another. Turns go round the tenants, so each of bob's waits for the slots to free about
    once (2 releases: alice's turn, then his), not for alice's queue (20 rounds). Counted
    two ways: alice's requests that finished while his waited (a turn each), and his wait
    against her longest request's own run time."""
    c = tenants
    flood, short = 40, 3

    held = [f"{HELD}flood-{i}" for i in range(SLOTS)]  # hold the slots until all queued

    async def timed(client, prompt, max_tokens, request_id=""):
        sent = time.monotonic()
        out = await client.generate(prompt, max_tokens=max_tokens, timeout=300,
                                    request_id=request_id, **GREEDY)
        return sent, time.monotonic(), out

    async def go():
        async with c.client("alice") as alice, c.client("bob") as bob:
            floods = [asyncio.ensure_future(timed(alice, f"flood {i}", 24, rid))
                      for i, rid in enumerate(held)]
            for rid in held:  # the slots are alice's: everything else she sends queues
                await gate_reached(c.address("decode"), "stream", f"{rid}@alice")
            floods += [asyncio.ensure_future(timed(alice, f"flood {i}", 24))
                       for i in range(SLOTS, flood)]

            async def queued() -> bool:
                return await asyncio.to_thread(c.in_router) >= flood
            await wait_for(queued, timeout_s=60)
            for rid in held:
                await gate_open(c.address("decode"), "stream", f"{rid}@alice")
            bobs = [await timed(bob, f"short {i}", 2) for i in range(short)]
            alices = await asyncio.gather(*floods)
        return alices, bobs

    alices, bobs = run(go(), timeout_s=600)
    assert all(len(out.token_ids) == 24 for _, _, out in alices)
    longest_run = max(done - sent - out.usage.queue_time_s
                      for sent, done, out in alices[SLOTS:])  # (the held ones waited at a gate)
    finished = sorted(done for _, done, _ in alices)
    for sent, done, out in bobs:
        waited = out.usage.queue_time_s
        turns = sum(1 for t in finished if sent <= t <= sent + waited)
        # 2 slots: the first release is alice's turn, the second bob's; one more for a
        # finish seen by the client a moment after its slot's release.
        assert turns <= SLOTS + 1, (turns, waited, longest_run)
        assert waited <= 2 * longest_run, (waited, longest_run)
    last_bob = max(done for _, done, _ in bobs)
    assert sum(1 for t in finished if t > last_bob) >= flood // 2, \
        "alice's flood had mostly drained before bob was served: no fairness shown"

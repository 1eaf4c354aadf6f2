"""A prefill node frozen (SIGSTOP) under load for longer than the lease, then resumed: every
client gets its answer, right, within the lease, the grace and one retry (issue 38).

The router here keeps sending the frozen node work until it finds it down (a RemoteSend
outlived its lease, then the health check timed out; `--prefill-saturated-wait-fraction
0`: the worst case), and the node is resumed at that moment. Requests sent to it in that
window (ids `held-…`) stop at its `prefill` test gate, as a real model's backlog would hold
them after the resume: their RemoteSends are still in flight on the router's channel to
the node when it passes its health check again. The router used to close that channel
then: each call on it was cancelled, its request's handler ended with CancelledError, gRPC
sent the client no status, and the client waited for its own deadline.
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from pdserve.client import AsyncClient
from tests.cluster.nodes import GREEDY, Cluster, full, run, wait_for, wait_pools_full, wait_until

LEASE_S = 5.0   # > the health check's timeout: held requests outlive the node's recovery
GRACE_S = 5.0   # the decode node's quarantine grace: it fences the node only after HEALTH_S
HEALTH_S = 2.0  # the router's health check timeout: how long it takes to find the node down
# Every client's wait: its first attempt (bounded by the lease), the grace, one retry
# (another lease, or the decode node prefilling), and generous room for a loaded machine.
# A bound the code enforces, not a claim of speed: a hung request waits for DEADLINE_S.
BOUND_S = LEASE_S + GRACE_S + LEASE_S + 12.0
DEADLINE_S = 45.0
CLIENTS = 32
HELD = "held-"  # the prefill node stops these at its `prefill` gate
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def frozen(tiny_model, tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("frozen-prefill-logs"), tiny_model)
    worker = ["--model", tiny_model, "--host", "127.0.0.1", "--num-threads", "1",
              "--page-size", "8"]
    try:
        c.start("p", ["prefill", *worker, "--num-pages", "256", "--test-gates", HELD], wait=False)
        c.start("d", ["decode", *worker, "--num-pages", "512",
                      "--quarantine-grace-ms", str(int(GRACE_S * 1000))], wait=False)
        c.wait("p", "d")
        c.start("router", ["router", "--model", tiny_model, "--host", "127.0.0.1",
                           "--prefill", c.address("p"), "--decode", c.address("d"),
                           "--lease-ms", str(int(LEASE_S * 1000)), "--health-interval-s", "0.3",
                           "--prefill-saturated-wait-fraction", "0"])
        yield c
    finally:
        c.stop()


def _prompt(i: int) -> list[int]:  # no two of the first 480 share even their first token
    return [(i * 31 + j * 7) % 480 + 20 for j in range(32)]


def test_prefill_node_frozen_past_its_lease_delays_no_client_past_the_bound(frozen):
    c = frozen
    p = c.address("p")
    sent = f"RemoteSend on prefill node {p}"  # in the router's log when one failed
    down, back = f"prefill node {p} is down", f"prefill node {p} passes its health check again"

    async def go():
        outcomes = []  # (i, started, ended, completion or error)
        pending: dict[int, float] = {}  # requests in flight: i -> started
        stop = asyncio.Event()
        count = iter(range(10**6))

        async def one(client, i, prefix="frozen-"):
            started = pending[i] = time.monotonic()
            try:
                out = await client.generate(_prompt(i), request_id=f"{prefix}{i}",
                                            max_tokens=MAX_TOKENS, timeout=DEADLINE_S, **GREEDY)
            except grpc.aio.AioRpcError as err:
                out = err
            outcomes.append((i, started, time.monotonic(), out))
            del pending[i]

        async def client_loop(client):
            while not stop.is_set():
                await one(client, next(count))

        async def answered(n):
            return len(outcomes) >= n

        async with AsyncClient(c.address("router")) as client:
            loops = [asyncio.ensure_future(client_loop(client)) for _ in range(CLIENTS)]
            await wait_for(lambda: answered(CLIENTS), timeout_s=60)  # traffic flows
            frozen_at = time.monotonic()
            c.nodes["p"].send_signal(signal.SIGSTOP)
            try:
                # A RemoteSend outlived its lease: the router checks the node's health and,
                # until the check times out, still sends it work. The held requests go now.
                await asyncio.to_thread(wait_until, lambda: sent in c.log_text("router"),
                                        "a RemoteSend to outlive its lease", LEASE_S + 30)
                held = [asyncio.ensure_future(one(client, 10**4 + k, HELD)) for k in range(4)]
                await asyncio.to_thread(wait_until, lambda: down in c.log_text("router"),
                                        "the router to find the frozen prefill node down",
                                        HEALTH_S + 30)
            finally:
                c.nodes["p"].send_signal(signal.SIGCONT)
            across = set(pending)  # in flight when the node was resumed
            await asyncio.to_thread(wait_until, lambda: back in c.log_text("router"),
                                    "the prefill node to pass its health check", 30)
            back_at = time.monotonic()

            async def across_ended():  # (or waited for its deadline: a hang)
                return not across & set(pending)

            await wait_for(across_ended, timeout_s=DEADLINE_S + 10)
            stop.set()
            await asyncio.gather(*loops, *held)

            async def disaggregated_again():
                o = await client.generate(_prompt(10**5), max_tokens=2, **GREEDY)
                return not o.usage.route.remote_send_skipped

            await wait_for(disaggregated_again, timeout_s=20, poll_s=0.3)
            # The answers of every request that overlapped the freeze, computed afresh by D.
            affected = [i for i, start, end, _ in outcomes if end >= frozen_at and start <= back_at]
            expected = {}
            for k in range(0, len(affected), 16):
                batch = affected[k:k + 16]
                fresh = await asyncio.gather(*(client.generate(
                    _prompt(i), kv_window_end=0, max_tokens=MAX_TOKENS, **GREEDY) for i in batch))
                expected.update(zip(batch, (f.token_ids for f in fresh)))
        return outcomes, across, expected, await wait_pools_full([p, c.address("d")])

    outcomes, across, expected, reports = run(go(), timeout_s=180)
    assert across, "no request was in flight when the prefill node was resumed"
    slow = [(i, round(end - start, 1), out if isinstance(out, Exception) else "ok")
            for i, start, end, out in outcomes if end - start > BOUND_S]
    assert not slow, f"{len(slow)} of {len(outcomes)} clients waited past {BOUND_S} s: {slow[:5]}"
    failed = [(i, out.code(), out.details()) for i, _, _, out in outcomes
              if isinstance(out, grpc.aio.AioRpcError)]
    assert not failed, f"{len(failed)} of {len(outcomes)} requests failed: {failed[:5]}"
    # The held requests were sent to the frozen node (then D prefilled them), not around it.
    held = {i: out.usage.route.skip_reason for i, _, _, out in outcomes if i >= 10**4}
    assert len(held) == 4 and set(held.values()) <= {"fallback", "lease_ended"}, held
    wrong = [i for i, out in ((i, out) for i, _, _, out in outcomes if i in expected)
             if out.token_ids != expected[i]]
    assert not wrong, f"{len(wrong)} of {len(expected)} answers changed: {wrong[:10]}"
    assert all(full(r) for r in reports), reports


"""Nodes dying and prefill nodes writing late, with real processes.

- SIGKILL of a prefill node mid-transfer: the router retries the other prefill node (or
  lets the decode node prefill) and the client gets one normal, correct stream.
- SIGKILL of a decode node: its stream ends UNAVAILABLE naming it, a stream on the other
  decode node is unaffected, the next requests succeed there, and once the node is back
  (same port) and passes its health check the router uses it again.
- A lease that runs out while a prefill node is still writing: the late write lands in
  quarantined pages, and no other request's output changes.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.client import AsyncClient
from pdserve.proto import pdserve_pb2
from pdserve.runtime.server import channel
from tests.cluster.conftest import HELD, SLOW
from tests.cluster.nodes import (GREEDY, full, gate_open, gate_reached, load, open_gates, run,
                                 stopped_at, wait_for, wait_pools_full, worker_stub)

LONG_IDS = [(i * 37) % 480 + 20 for i in range(300)]


async def _fresh(client, prompt, max_tokens):
    """The answer computed from scratch on a decode node (no transfer, no prefix cache)."""
    return await client.generate(prompt, kv_window_end=0, max_tokens=max_tokens, **GREEDY)


def test_sigkill_prefill_node_during_transfer_still_gives_the_right_answer(fault_cluster):
    """Router `short` (2 s leases): the reservation the dead node was writing is
    quarantined until its lease plus the grace period, then comes back."""
    c = fault_cluster
    request_id = f"{SLOW}kill-prefill"

    async def go():
        await open_gates(c, "prefill", request_id)
        async with AsyncClient(c.address("short")) as client:
            task = asyncio.ensure_future(client.generate(
                LONG_IDS, request_id=request_id, max_tokens=8, **GREEDY))
            victim = await stopped_at(c, "kv_write", request_id)
            survivor = "p2" if victim == "p1" else "p1"
            await gate_open(c.address(survivor), "kv_write", request_id)  # the retry goes on
            assert (await load(c.address(victim))).num_running == 1
            c.kill(victim)
            out = await task
            expected = await _fresh(client, LONG_IDS, 8)
        survivors = [c.address(n) for n in ("p1", "p2", "d1", "d2") if n != victim]
        # D's reservation written by the dead node never gets a notification: it stays
        # quarantined until its lease (2 s) plus the grace period.
        reports = await wait_pools_full(survivors)
        return victim, out, expected, reports

    try:
        victim, out, expected, reports = run(go())
    finally:
        for name in ("p1", "p2"):
            if not c.nodes[name].alive():
                c.restart(name)
    assert out.token_ids == expected.token_ids and len(out.token_ids) == 8
    assert out.finish_reason == "length"
    route = out.usage.route
    # Sent by the survivor; or, when its retry too outlived the 2 s lease (a loaded
    # machine), prefilled by D, and the route says why.
    if route.remote_send_skipped:
        assert route.skip_reason in ("fallback", "lease_ended"), route
    else:
        assert route.prefill_endpoint == c.address("p2" if victim == "p1" else "p1"), route
    assert all(full(r) for r in reports), reports


def test_sigkill_decode_node_is_unavailable_naming_it_in_the_log_and_traffic_moves_on(
        fault_cluster):
    """Streams whose id starts with `held-` stop at their decode node's `stream` gate after
    their first token, so both are still open, on known nodes, when one node is killed."""
    c = fault_cluster
    decodes = ("d1", "d2")
    killed: list[str] = []

    async def first_tokens(client, request_id, max_tokens):
        stream = client.responses(f"a long story {request_id}", request_id=request_id,
                               max_tokens=max_tokens, **GREEDY)
        msg = await stream.__anext__()
        return stream, list(msg.token_ids), await stopped_at(c, "stream", request_id, decodes)

    async def drain(stream):
        tokens, reason = [], ""
        async for msg in stream:
            tokens += msg.token_ids
            reason = msg.finish_reason or reason
        return tokens, reason

    async def go():
        async with AsyncClient(c.address("main")) as client:
            doomed, _, victim = await first_tokens(client, f"{HELD}doomed", 400)
            other = "d2" if victim == "d1" else "d1"
            for i in range(4):  # round robin: one of the next streams lands on the other node
                bystander_id = f"{HELD}bystander-{i}"
                bystander, got, node = await first_tokens(client, bystander_id, 120)
                if node == other:
                    break
                await stream_close(bystander)
            else:
                pytest.fail("no stream landed on the other decode node")
            killed.append(victim)
            c.kill(victim)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await drain(doomed)
            await gate_open(c.address(other), "stream", bystander_id)
            rest, reason = await drain(bystander)
            after = [await client.generate(f"next request {i}", max_tokens=4, **GREEDY)
                     for i in range(4)]
            survivors = await wait_pools_full([c.address(n) for n in ("p1", "p2", other)])
            c.restart(victim)

            async def routed_to_victim():
                out = await client.generate("welcome back", max_tokens=2, **GREEDY)
                return out.usage.route.decode_endpoint == c.address(victim)

            await wait_for(routed_to_victim, timeout_s=15, poll_s=0.2)
        return victim, other, err.value, got + rest, reason, after, survivors

    try:
        victim, other, err, bystander_tokens, reason, after, survivors = run(go(), timeout_s=180)
    finally:  # the nodes are shared by the tests after this one
        for name in killed:
            if not c.nodes[name].alive():
                c.restart(name)
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert "retry" in err.details() and c.address(victim) not in err.details()
    assert any(f"{HELD}doomed" in line and f"decode node {c.address(victim)}" in line
               for line in c.log_text("main").splitlines())  # the node: in the log, not to clients
    assert len(bystander_tokens) == 120 and reason == "length"
    assert all(len(o.token_ids) == 4 for o in after)
    assert all(o.usage.route.decode_endpoint == c.address(other) for o in after)
    assert all(full(r) for r in survivors), survivors


async def stream_close(stream):
    await stream.aclose()


def test_lease_expiry_while_prefill_node_still_writes_changes_no_other_output(fault_cluster):
    """Router `short` leases for 2 s. The slow request's write is held at the `kv_write`
    gate of both prefill nodes it tries until each lease has ended (the router then lets
    the decode node prefill it itself); then both writes land, late, into quarantined
    pages. Meanwhile other requests run on the same decode nodes; their outputs must equal
    a fresh recomputation."""
    c = fault_cluster
    decodes = [c.address(d) for d in ("d1", "d2")]
    request_id = f"{SLOW}late-writer"

    def bystander(i):  # distinct from the first token on: no prefix sharing, 8 fresh pages
        return [(i * 13 + j * 7) % 480 + 20 for j in range(64)]

    async def quarantined() -> int:
        return sum([(await load(d)).num_quarantined for d in decodes])

    async def none_quarantined() -> bool:
        return await quarantined() == 0

    async def go():
        before = sum([(await load(d)).late_writes_total for d in decodes])
        await open_gates(c, "prefill", request_id)
        async with AsyncClient(c.address("short")) as short, AsyncClient(c.address("main")) as main:
            slow = asyncio.ensure_future(short.generate(
                LONG_IDS[:120], request_id=request_id, max_tokens=6, **GREEDY))
            outs = []
            stop = asyncio.Event()

            async def bystanders():
                while not stop.is_set():
                    batch = [bystander(len(outs) + k) for k in range(6)]
                    outs.extend(zip(batch, await asyncio.gather(*(
                        main.generate(p, max_tokens=6, **GREEDY) for p in batch))))

            async def batch_ended_since(ran: int) -> bool:
                return len(outs) > ran

            traffic = asyncio.ensure_future(bystanders())
            for attempt in range(2):  # one prefill node, then the other
                prefill = await stopped_at(c, "kv_write", request_id)
                await wait_for(quarantined, timeout_s=10)  # its lease ended: D quarantined
                # Bystanders run while D holds those pages, however slow the machine.
                ran = len(outs)
                await wait_for(lambda: batch_ended_since(ran), timeout_s=60)
                await gate_open(c.address(prefill), "kv_write", request_id)  # lands late
                await wait_for(none_quarantined, timeout_s=10)  # D saw it land
            out = await slow
            stop.set()
            await traffic
            expected = []
            for i in range(0, len(outs), 8):
                expected += await asyncio.gather(*(_fresh(main, p, 6) for p, _ in outs[i:i + 8]))
            slow_expected = await _fresh(main, LONG_IDS[:120], 6)
        reports = await wait_pools_full([*c.workers])
        after = sum([r.late_writes_total for r in reports if r.role == "decode"])
        return out, slow_expected, outs, expected, after - before, reports

    out, slow_expected, outs, expected, late_writes, reports = run(go(), timeout_s=240)
    assert late_writes == 2  # both prefill nodes really wrote after their leases ended
    assert out.token_ids == slow_expected.token_ids
    assert out.usage.route.remote_send_skipped  # both prefill attempts ran out of lease
    mismatched = [i for i, ((_, o), e) in enumerate(zip(outs, expected)) if o.token_ids != e.token_ids]
    assert not mismatched, f"{len(mismatched)} of {len(outs)} bystanders changed: {mismatched}"
    assert all(full(r) for r in reports), reports


def test_pages_of_an_expired_lease_are_not_reused_until_the_late_write_lands(fault_cluster):
    """Worker API straight, deterministic: a prefill node's write is held at its gate until
    the lease has ended. With the pool otherwise full, no reservation may get the expired
    one's pages until that write has landed; then they come back."""
    c = fault_cluster
    d1, p1 = c.address("d1"), c.address("p1")
    x_id = f"{SLOW}x"

    def ids(i, n):
        return [(i * 11 + j * 7) % 480 + 20 for j in range(n)]

    async def prepare(stub, rid, prompt, lease_ms, timeout=10):  # p1 named as the writer
        return await stub.PrepareReceive(pdserve_pb2.PrepareReceiveRequest(
            request_id=rid, prompt_token_ids=prompt, kv_window_end=-1, lease_ms=lease_ms,
            writer_address=p1), timeout=timeout)

    async def go():
        async with channel(d1) as dch, channel(p1) as pch:
            d, p = worker_stub(dch), worker_stub(pch)
            before = (await load(d1)).late_writes_total
            await gate_open(p1, "prefill", x_id)
            # Not a progression like every other test's prompts (the bystanders of the test
            # above reach (11*999 + 7j) at i=33): D must hold none of X's prompt.
            x_ids = [(j * j * 5 + 3) % 480 + 20 for j in range(121)]
            x = await prepare(d, x_id, x_ids, 1000)
            assert x.prefix_matched_length == 0, x
            x_slots = set(slots(x.kv_append_metadata))
            send = asyncio.ensure_future(p.RemoteSend(pdserve_pb2.RemoteSendRequest(
                request_id=x_id, prompt_token_ids=x_ids, kv_window_begin=x.prefix_matched_length,
                kv_window_end=x.kv_window_end, kv_append_metadata=x.kv_append_metadata,
                lease_id=x.lease_id, decode_agent_name=x.decode_agent_name, decode_address=d1,
                lease_remaining_ms=x.lease_ms, lease_ms=x.lease_ms, capability=x.capability,
                issued_unix_ms=x.issued_unix_ms), timeout=30))
            await gate_reached(p1, "kv_write", x_id)  # its write has begun, held
            # Fill the pool until another filler would not fit, counted in D's free pages (a
            # cached page counts as free, so a prefix hit changes no filler's share).
            fillers, free, need = [], (await load(d1)).free_pages, 0
            while free >= need:
                fillers.append(await prepare(d, f"fill-{len(fillers)}", ids(len(fillers), 65),
                                             60_000))
                left = (await load(d1)).free_pages
                assert left < free, "a filler reserved no page"
                need, free = max(need, free - left), left
            await wait_for(lambda: _quarantined(d1), timeout_s=5)  # X's lease has ended
            during = []
            for k in range(3):  # nobody gets X's pages while its write may still land
                try:
                    # A short deadline: D's line for pages gives up within it (or, on a
                    # loaded machine, the deadline passes first), where it would otherwise
                    # wait for pages to come back.
                    r = await prepare(d, f"during-{k}", ids(500 + k, 17), 60_000, timeout=1)
                    during.append(set(slots(r.kv_append_metadata)))
                except grpc.aio.AioRpcError as err:
                    assert err.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                          grpc.StatusCode.DEADLINE_EXCEEDED), err
            await gate_open(p1, "kv_write", x_id)
            sent = await send  # the late write landed (the prefill node says so)
            await wait_for(lambda: _not_quarantined(d1), timeout_s=5)
            late = (await load(d1)).late_writes_total - before
            after = await prepare(d, "after", ids(700, 121), 60_000)
            for rid in [f"fill-{j}" for j in range(len(fillers))] + \
                    [f"during-{k}" for k in range(3)] + ["after"]:
                await d.Abort(pdserve_pb2.AbortRequest(request_id=rid, kv_write_settled=True),
                              timeout=5)
        return x_slots, during, sent, late, after, await wait_pools_full([d1, p1])

    x_slots, during, sent, late, after, reports = run(go())
    assert sent.num_tokens_sent == 120 and late == 1
    assert all(not (s & x_slots) for s in during), "an expired reservation's pages were reused"
    assert set(slots(after.kv_append_metadata)) & x_slots  # back in the pool once it landed
    assert all(full(r) for r in reports), reports


async def _quarantined(address):
    return (await load(address)).num_quarantined == 1


async def _not_quarantined(address):
    return (await load(address)).num_quarantined == 0


def slots(meta) -> list[int]:
    from pdserve.kvtransfer.metadata import decode_append_metadata

    return decode_append_metadata(list(meta))

"""Aborts and cancellations at every phase of a send.

The set-up, and how a phase is reached without waiting for time: tests/prefill/world.py.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from pdserve.prefill.requests import RemoteSend
from pdserve.proto.tags import notification_tag
from pdserve.runtime.errors import RequestAborted
from pdserve.runtime.gates import Gates
from tests.prefill.world import (
    D_PAGE,
    END,
    GATED,
    LEASE,
    P_PAGES,
    PROMPT,
    WAIT_S,
    PrefillWatch,
    engine_requests,
    free_pages,
    hold_in_forward,
    kv_of,
    with_slots,
    within,
)

# ---- aborts ------------------------------------------------------------------------------

def test_abort_before_prefill_sends_no_write_notice_and_writes_nothing(nodes):
    async def go():
        gates = Gates(GATED)
        role = nodes.role(gates=gates)
        res = await nodes.reserve("g-a")
        before = await kv_of(nodes.decode)
        send = asyncio.ensure_future(role.remote_send(RemoteSend("g-a", PROMPT, END, nodes.window(res))))
        await within(gates.reached("prefill", "g-a"))
        assert await role.abort("g-a") is True
        gates.open("prefill", "g-a")
        with pytest.raises(RequestAborted, match="before prefill"):
            await within(send)
        assert await nodes.no_write_notice("g-a")
        assert nodes.d_agent.take_notifications() == []  # and no KV-ready tag
        assert nodes.p_agent.writes == [] and nodes.d_agent.received == []
        assert torch.equal(await kv_of(nodes.decode), before)
        assert await engine_requests(nodes.prefill) == []
        assert await role.abort("g-a") is False  # nothing left to abort
        await nodes.unreserve("g-a")

    asyncio.run(go())


def test_abort_in_the_middle_of_a_chunked_prefill_frees_its_pages_and_writes_nothing(nodes):
    """A prefill of 28 tokens in chunks of 8: the abort reaches the engine between chunks."""
    async def go():
        node = nodes.prefill_node("chunked-agent", max_num_batched_tokens=8)
        engine = node[0]
        role = nodes.role(node=node)
        res = await nodes.reserve("a")
        before = await kv_of(nodes.decode)
        hook, reached, proceed = hold_in_forward("a")
        engine.add_layer_hook(hook)
        send = asyncio.ensure_future(role.remote_send(RemoteSend("a", PROMPT, END, nodes.window(res))))
        assert await asyncio.to_thread(reached.wait, WAIT_S)
        abort = asyncio.ensure_future(role.abort("a"))
        await asyncio.sleep(0)  # one pass of the event loop (no time passes): the abort
        assert role.in_flight["a"].aborted  # has run up to its engine call, now queued
        proceed.set()
        assert await within(abort) is True
        with pytest.raises(RequestAborted, match="during prefill"):
            await within(send)
        engine.remove_layer_hook(hook)
        assert await free_pages(engine) == (P_PAGES, P_PAGES)
        assert await nodes.no_write_notice("a")
        assert nodes.d_agent.take_notifications() == []
        assert node[1].writes == [] and torch.equal(await kv_of(nodes.decode), before)
        await nodes.unreserve("a")

    asyncio.run(go())


def test_abort_after_prefill_before_write_releases_pages_and_sends_no_write_notice(nodes):
    async def go():
        watch = PrefillWatch(nodes.prefill)
        role = nodes.role(node=(watch, nodes.p_agent, nodes.p_layout))
        res = await nodes.reserve("a")
        watch.resume["a"] = asyncio.Event()
        send = asyncio.ensure_future(role.remote_send(RemoteSend("a", PROMPT, END, nodes.window(res))))
        await within(watch.event("a").wait())
        assert await free_pages(nodes.prefill) < (P_PAGES, P_PAGES)
        assert await role.abort("a") is True
        assert await free_pages(nodes.prefill) == (P_PAGES, P_PAGES)  # freed by the abort itself
        watch.resume["a"].set()
        with pytest.raises(RequestAborted, match="aborted before writing"):
            await within(send)  # the slots the prefill reported are freed: nothing reads them
        assert await nodes.no_write_notice("a")
        assert nodes.p_agent.writes == [] and nodes.d_agent.take_notifications() == []
        await nodes.unreserve("a")

    asyncio.run(go())


async def send_held_in_its_write(nodes):
    """Request "w" sent with its write in flight, held until `hold.release()`: the role, the
    reservation, the decode KV before, the hold, the send task and the KV it is writing."""
    role = nodes.role()
    res = await nodes.reserve("w")
    before = await kv_of(nodes.decode)
    hold = nodes.p_agent.hold_writes()
    send = asyncio.ensure_future(role.remote_send(RemoteSend("w", PROMPT, END, nodes.window(res))))
    sent = await nodes.sent_kv_while_held(hold, "w", 0)
    return role, res, before, hold, send, sent


async def assert_write_landed(nodes, res, before, sent) -> None:
    """The held write reached the decode pages, notified once, and "w" is unreserved."""
    assert torch.equal(await kv_of(nodes.decode), with_slots(before, res.slots, D_PAGE, sent))
    assert nodes.d_agent.take_notifications() == [
        ("prefill-agent", notification_tag("w", LEASE))]
    await nodes.unreserve("w")


def test_abort_during_write_lets_it_land_and_releases_source_pages_only_after_it(nodes):
    async def go():
        role, res, before, hold, send, sent = await send_held_in_its_write(nodes)
        assert await role.abort("w") is True
        # The write is in flight: its source pages stay pinned and nothing has landed yet.
        assert len(await nodes.prefill.run(lambda e: e.slots_of("w"))) == END
        assert await free_pages(nodes.prefill) < (P_PAGES, P_PAGES)
        assert not send.done() and torch.equal(await kv_of(nodes.decode), before)
        hold.release()
        result = await within(send)
        assert result.num_tokens_sent == END
        assert await free_pages(nodes.prefill) == (P_PAGES, P_PAGES)
        await assert_write_landed(nodes, res, before, sent)

    asyncio.run(go())


def test_cancelled_send_waits_for_its_write_in_flight_before_releasing_source_pages(nodes):
    async def go():
        _, res, before, hold, send, sent = await send_held_in_its_write(nodes)
        send.cancel()
        # An engine round trip lets the send process its cancellation (anything it would
        # then ask the engine comes before the next command); its pages stay pinned.
        await nodes.prefill.run(lambda e: None)
        assert len(await nodes.prefill.run(lambda e: e.slots_of("w"))) == END
        assert not send.done()
        hold.release()
        with pytest.raises(asyncio.CancelledError):
            await within(send)
        assert await free_pages(nodes.prefill) == (P_PAGES, P_PAGES)
        await assert_write_landed(nodes, res, before, sent)

    asyncio.run(go())


def test_abort_of_an_unknown_request_is_false(nodes):
    async def go():
        assert await nodes.role().abort("nobody") is False

    asyncio.run(go())

"""The overlapped kind: a window delivered before, during or after the prefill.

The set-up, and how a phase is reached without waiting for time: tests/prefill/world.py.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

import pdserve.prefill.role
from pdserve.kvtransfer.metadata import encode_append_metadata
from pdserve.prefill.requests import OverlappedSend
from pdserve.proto.tags import notification_tag
from pdserve.runtime.errors import RequestAborted, TimedOut
from pdserve.runtime.gates import Gates
from tests.fake_clock import FakeClock
from tests.prefill.world import (
    D_PAGE,
    END,
    GATED,
    LEASE,
    P_PAGES,
    PROMPT,
    WAIT_S,
    PrefillWatch,
    drained,
    free_pages,
    generate_tokens,
    hold_in_forward,
    kv_of,
    started_tokens,
    with_slots,
    within,
)


@pytest.mark.parametrize("when", ["before", "during", "after"])
def test_overlapped_send_writes_the_window_delivered_before_during_or_after_the_prefill(
        nodes, when):
    async def go():
        watch = PrefillWatch(nodes.prefill)
        role = nodes.role(node=(watch, nodes.p_agent, nodes.p_layout))
        expected = await generate_tokens(nodes.engine(), "local", PROMPT)
        res = await nodes.reserve("o")
        window = nodes.window(res)
        before = await kv_of(nodes.decode)
        hold = nodes.p_agent.hold_writes()

        if when == "before":
            assert await role.deliver_window("o", window) is False  # kept for its send
            send = asyncio.ensure_future(role.remote_send_overlapped(OverlappedSend("o", PROMPT, END)))
        elif when == "during":
            hook, reached, proceed = hold_in_forward("o")
            nodes.prefill.add_layer_hook(hook)
            send = asyncio.ensure_future(role.remote_send_overlapped(OverlappedSend("o", PROMPT, END)))
            assert await asyncio.to_thread(reached.wait, WAIT_S), "the prefill never ran"
            try:
                assert await role.deliver_window("o", window) is True
                assert not send.done()
            finally:
                proceed.set()
            nodes.prefill.remove_layer_hook(hook)
        else:
            send = asyncio.ensure_future(role.remote_send_overlapped(OverlappedSend("o", PROMPT, END)))
            await within(watch.event("o").wait())
            assert not send.done() and nodes.p_agent.writes == []
            assert await role.deliver_window("o", window) is True

        sent = await nodes.sent_kv_while_held(hold, "o", 0)
        hold.release()
        result = await within(send)
        assert (result.kv_window_begin, result.kv_window_end) == (0, END)
        assert torch.equal(await kv_of(nodes.decode), with_slots(before, res.slots, D_PAGE, sent))
        assert nodes.d_agent.take_notifications() == [
            ("prefill-agent", notification_tag("o", LEASE))]
        assert await started_tokens(nodes.decode, "o") == expected

    asyncio.run(go())


def test_overlapped_send_whose_window_never_comes_times_out_without_writing(nodes, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(pdserve.prefill.role, "time", clock)

    async def go():
        gates = Gates(GATED)
        role = nodes.role(gates=gates)
        send = asyncio.ensure_future(role.remote_send_overlapped(
            OverlappedSend("g-o", PROMPT, END, timeout_s=0.3)))
        await within(gates.reached("prefill", "g-o"))
        clock.advance(6.0)
        gates.open("prefill", "g-o")
        with pytest.raises(TimedOut, match="did not arrive before its deadline"):
            await within(send)
        await drained(role)
        assert nodes.p_agent.writes == [] and nodes.d_agent.take_notifications() == []
        assert role.load().num_running == 0

    asyncio.run(go())


def test_overlapped_send_aborted_while_waiting_for_its_window_writes_nothing(nodes):
    async def go():
        watch = PrefillWatch(nodes.prefill)
        role = nodes.role(node=(watch, nodes.p_agent, nodes.p_layout))
        send = asyncio.ensure_future(role.remote_send_overlapped(OverlappedSend("o", PROMPT, END)))
        await within(watch.event("o").wait())
        assert await free_pages(nodes.prefill) < (P_PAGES, P_PAGES)  # prefilled, pinned
        assert await role.abort("o") is True
        with pytest.raises(RequestAborted, match="waiting for its KV window"):
            await within(send)
        assert await free_pages(nodes.prefill) == (P_PAGES, P_PAGES)
        await drained(role)
        assert nodes.p_agent.writes == [] and nodes.d_agent.take_notifications() == []

    asyncio.run(go())


def test_window_that_comes_after_its_send_ended_is_never_written_and_decode_hears_so(nodes):
    """A send aborted before its window came: the window the router still delivers gets a
    no-write notice at once, so the decode node need not hold the pages till lease + grace."""
    async def go():
        role = nodes.role()
        send = asyncio.ensure_future(role.remote_send_overlapped(OverlappedSend("late", PROMPT,
                                                                                END)))
        await asyncio.sleep(0)  # the send is admitted (one loop turn, no time passes)
        assert await role.abort("late") is True
        with pytest.raises(RequestAborted):
            await within(send)
        res = await nodes.reserve("late-key")
        assert await role.deliver_window("late", nodes.window(res)) is False
        assert await nodes.no_write_notice("late")
        await drained(role)
        assert nodes.p_agent.writes == []
        await nodes.unreserve("late-key")

    asyncio.run(go())


def test_overlapped_window_with_bad_metadata_fails_the_send_and_tells_decode_no_write(nodes):
    async def go():
        watch = PrefillWatch(nodes.prefill)
        role = nodes.role(node=(watch, nodes.p_agent, nodes.p_layout))
        res = await nodes.reserve("o")
        before = await kv_of(nodes.decode)
        bad = dataclasses.replace(nodes.window(res),
                                  kv_append_metadata=encode_append_metadata(res.slots[:-1]))
        send = asyncio.ensure_future(role.remote_send_overlapped(OverlappedSend("o", PROMPT, END)))
        await within(watch.event("o").wait())
        assert await role.deliver_window("o", bad) is True
        with pytest.raises(ValueError, match=f"add up to {END - 1}, but the window has {END} tokens"):
            await within(send)
        assert await nodes.no_write_notice("o")
        assert nodes.p_agent.writes == [] and torch.equal(await kv_of(nodes.decode), before)
        await nodes.unreserve("o")

    asyncio.run(go())


def test_overlapped_send_fails_with_the_reason_its_window_was_malformed(nodes):
    async def go():
        watch = PrefillWatch(nodes.prefill)
        role = nodes.role(node=(watch, nodes.p_agent, nodes.p_layout))
        send = asyncio.ensure_future(role.remote_send_overlapped(OverlappedSend("o", PROMPT, END)))
        await within(watch.event("o").wait())
        reason = ValueError("lease_id must be set, got ''")
        with pytest.raises(ValueError, match="lease_id must be set"):
            await role.deliver_window("o", reason)
        with pytest.raises(ValueError, match="lease_id must be set"):
            await within(send)
        await drained(role)
        assert nodes.p_agent.writes == [] and nodes.d_agent.take_notifications() == []

    asyncio.run(go())

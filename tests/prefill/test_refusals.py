"""Leases, deadlines, and every refusal before a write.

The set-up, and how a phase is reached without waiting for time: tests/prefill/world.py.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

import pdserve.prefill.role
from pdserve.kvtransfer.layout import KVLayout
from pdserve.prefill.peers import IncompatiblePeer
from pdserve.prefill.requests import OverlappedSend, RemoteSend
from pdserve.prefill.role import LeaseEnded
from pdserve.proto.tags import notification_tag
from pdserve.runtime.errors import NodeDraining, NodeOverloaded, PeerUnavailable, Refused, TimedOut
from pdserve.runtime.gates import Gates
from tests.fake_clock import FakeClock
from tests.prefill.world import (
    D_PAGE,
    END,
    GATED,
    LEASE,
    P_PAGES,
    PROMPT,
    PROMPT_LEN,
    drained,
    engine_requests,
    free_pages,
    kv_of,
    within,
)

# ---- leases and deadlines ------------------------------------------------------------------

def test_window_whose_lease_already_ended_is_refused_before_anything_runs(nodes):
    async def go():
        role = nodes.role()
        res = await nodes.reserve("l")
        before = await kv_of(nodes.decode)
        with pytest.raises(LeaseEnded, match="lease of request 'l' ended") as err:
            await role.remote_send(RemoteSend("l", PROMPT, END, nodes.window(res, expires_in_s=-1.0)))
        assert isinstance(err.value, Refused)
        assert await engine_requests(nodes.prefill) == [] and role.load().num_running == 0
        await drained(role)
        assert nodes.p_agent.writes == [] and nodes.d_agent.take_notifications() == []
        assert torch.equal(await kv_of(nodes.decode), before)
        await nodes.unreserve("l")

    asyncio.run(go())


def test_lease_that_ends_during_prefill_stops_the_write_and_sends_no_write_notice(nodes, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(pdserve.prefill.role, "time", clock)

    async def go():
        gates = Gates(GATED)
        role = nodes.role(gates=gates)
        res = await nodes.reserve("g-l")
        before = await kv_of(nodes.decode)
        send = asyncio.ensure_future(role.remote_send(RemoteSend(
            "g-l", PROMPT, END, nodes.window(res, expires_in_s=10.0, clock=clock))))
        await within(gates.reached("prefill", "g-l"))
        clock.advance(11.0)
        gates.open("prefill", "g-l")
        with pytest.raises(LeaseEnded):
            await within(send)
        assert await nodes.no_write_notice("g-l")
        assert nodes.p_agent.writes == [] and torch.equal(await kv_of(nodes.decode), before)
        await nodes.unreserve("g-l")

    asyncio.run(go())


def test_deadline_that_passes_during_prefill_stops_the_write_and_sends_no_write_notice(
        nodes, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(pdserve.prefill.role, "time", clock)

    async def go():
        gates = Gates(GATED)
        role = nodes.role(gates=gates)
        res = await nodes.reserve("g-d")
        send = asyncio.ensure_future(role.remote_send(RemoteSend(
            "g-d", PROMPT, END, nodes.window(res, clock=clock), timeout_s=5.0)))
        await within(gates.reached("prefill", "g-d"))
        clock.advance(6.0)
        gates.open("prefill", "g-d")
        with pytest.raises(TimedOut, match="reached its deadline before writing"):
            await within(send)
        assert await nodes.no_write_notice("g-d")
        assert nodes.p_agent.writes == []
        await nodes.unreserve("g-d")

    asyncio.run(go())


def test_write_is_bounded_by_the_lease_end_not_only_the_transfer_timeout(nodes):
    async def go():
        # A lease far longer than the work, so that a loaded machine still writes within it.
        role = nodes.role(transfer_timeout_s=120.0)
        res = await nodes.reserve("b")
        await within(role.remote_send(RemoteSend("b", PROMPT, END, nodes.window(res, expires_in_s=20.0))))
        [write] = nodes.p_agent.writes
        assert 0 < write.timeout_s <= 20.0
        await nodes.unreserve("b")

    asyncio.run(go())


# ---- refusals ------------------------------------------------------------------------------

def _bad(name, change, message):
    return pytest.param(change, message, id=name)


BAD_REQUESTS = [
    _bad("end-is-prompt-length", lambda r: dataclasses.replace(r, kv_window_end=PROMPT_LEN),
         rf"kv window \[0, {PROMPT_LEN}\) is invalid for a prompt of length {PROMPT_LEN}"),
    _bad("begin-not-before-end", lambda r: dataclasses.replace(
        r, kv_window_end=10, window=dataclasses.replace(r.window, begin=10)), r"\[10, 10\)"),
    _bad("begin-before-prompt", lambda r: dataclasses.replace(
        r, window=dataclasses.replace(r.window, begin=-40)), rf"kv window \[-40, {END}\)"),
    _bad("end-not-int", lambda r: dataclasses.replace(r, kv_window_end=28.0),
         "kv_window_end must be an int, got 28.0"),
    _bad("metadata-short", lambda r: dataclasses.replace(r, window=dataclasses.replace(
        r.window, kv_append_metadata=[1, 0, END - 1])),
         f"segment lengths add up to {END - 1}, but the window has {END} tokens"),
    _bad("metadata-past-pool", lambda r: dataclasses.replace(r, window=dataclasses.replace(
        r.window, kv_append_metadata=[1, 500, END])),
         rf"segment 0 \(start=500, length={END}\) runs past the pool of 512 slots"),
    _bad("metadata-wrong-count", lambda r: dataclasses.replace(r, window=dataclasses.replace(
        r.window, kv_append_metadata=[2, 0, END])), "num_segments=2 must have 5 values, got 3"),
    _bad("metadata-repeats-slot", lambda r: dataclasses.replace(r, window=dataclasses.replace(
        r.window, kv_append_metadata=[2, 0, 14, 0, 14])), "names the same slot more than once"),
    _bad("metadata-not-int", lambda r: dataclasses.replace(r, window=dataclasses.replace(
        r.window, kv_append_metadata=[1, 0, "28"])), r"append metadata\[2\] must be an int, got '28'"),
    _bad("metadata-negative-start", lambda r: dataclasses.replace(r, window=dataclasses.replace(
        r.window, kv_append_metadata=[1, -1, END])), "segment 0 start must be >= 0, got -1"),
    _bad("metadata-empty", lambda r: dataclasses.replace(r, window=dataclasses.replace(
        r.window, kv_append_metadata=[])), "append metadata is empty"),
]


@pytest.mark.parametrize(("change", "message"), BAD_REQUESTS)
def test_bad_window_or_metadata_raises_value_error_naming_the_value_and_writes_nothing(
        nodes, change, message):
    async def go():
        role = nodes.role()
        res = await nodes.reserve("v")
        before = await kv_of(nodes.decode)
        with pytest.raises(ValueError, match=message):
            await role.remote_send(change(RemoteSend("v", PROMPT, END, nodes.window(res))))
        assert role.load().num_running == 0 and await engine_requests(nodes.prefill) == []
        await drained(role)
        assert nodes.p_agent.writes == [] and nodes.d_agent.take_notifications() == []
        assert torch.equal(await kv_of(nodes.decode), before)
        await nodes.unreserve("v")

    asyncio.run(go())


def test_overlapped_send_with_a_bad_window_end_is_refused_before_prefill(nodes):
    async def go():
        role = nodes.role()
        with pytest.raises(ValueError, match=rf"kv window \[0, -{PROMPT_LEN + 1}\)"):
            await role.remote_send_overlapped(OverlappedSend("o", PROMPT, -PROMPT_LEN - 1))
        assert role.load().num_running == 0 and await engine_requests(nodes.prefill) == []

    asyncio.run(go())


def _layout_with_three_layers() -> KVLayout:
    return KVLayout.from_tensor(torch.zeros(4, 3, 2, D_PAGE, 2, 16), D_PAGE)


@pytest.mark.parametrize("case", ["other-agent-name", "other-layer-count"])
def test_decode_peer_that_cannot_take_this_kv_is_refused_before_any_handshake(nodes, case):
    async def go():
        role = nodes.role()
        res = await nodes.reserve("p")
        window = nodes.window(res)
        if case == "other-agent-name":  # the decode node restarted under a new agent name
            window = dataclasses.replace(window, decode=dataclasses.replace(
                window.decode, agent_name="decode-agent-before-restart"))
            message = "runs agent 'decode-agent', not 'decode-agent-before-restart'"
        else:
            info = dataclasses.replace(window.decode.info, layout=_layout_with_three_layers())
            window = dataclasses.replace(window, decode=dataclasses.replace(window.decode, info=info))
            message = "num_layers differs: 2 vs 3"
        with pytest.raises(IncompatiblePeer, match=message):
            await role.remote_send(RemoteSend("p", PROMPT, END, window))
        # the overlapped kind: the waiting send fails with the same reason
        send = asyncio.ensure_future(role.remote_send_overlapped(OverlappedSend("p", PROMPT, END)))
        with pytest.raises(IncompatiblePeer, match=message):
            await role.deliver_window("p", window)
        with pytest.raises(IncompatiblePeer, match=message):
            await within(send)
        assert nodes.p_agent.add_remote_calls == 0 and nodes.p_agent.writes == []
        await nodes.unreserve("p")

    asyncio.run(go())


@pytest.mark.parametrize("kind", ["remote_send", "overlapped"])
def test_duplicate_request_id_is_refused_while_the_first_send_runs(nodes, kind):
    async def go():
        gates = Gates(GATED)
        role = nodes.role(gates=gates)
        res = await nodes.reserve("g-dup")
        first = asyncio.ensure_future(role.remote_send(RemoteSend("g-dup", PROMPT, END, nodes.window(res))))
        await within(gates.reached("prefill", "g-dup"))
        with pytest.raises(ValueError, match="duplicate request_id 'g-dup'"):
            if kind == "remote_send":  # another lease: the same one would be a replay
                await role.remote_send(RemoteSend("g-dup", PROMPT, END,
                                                  nodes.window(res, lease_id="lease-2")))
            else:
                await role.remote_send_overlapped(OverlappedSend("g-dup", PROMPT, END))
        gates.open("prefill", "g-dup")
        gates.open("kv_write", "g-dup")
        assert (await within(first)).num_tokens_sent == END
        assert len(nodes.p_agent.writes) == 1
        assert nodes.d_agent.take_notifications() == [
            ("prefill-agent", notification_tag("g-dup", LEASE))]
        await nodes.unreserve("g-dup")

    asyncio.run(go())


@pytest.mark.parametrize("limit", ["max_in_flight", "draining"])
def test_full_or_draining_node_refuses_new_sends_and_finishes_admitted_ones(nodes, limit):
    async def go():
        gates = Gates(GATED)
        role = nodes.role(gates=gates, max_in_flight=1)
        res = await nodes.reserve("g-1")
        first = asyncio.ensure_future(role.remote_send(RemoteSend("g-1", PROMPT, END, nodes.window(res))))
        await within(gates.reached("prefill", "g-1"))
        if limit == "draining":
            role.draining = True
            error, message = NodeDraining, "draining"
        else:
            error, message = NodeOverloaded, "limit of 1 RemoteSends"
        assert role.busy()
        with pytest.raises(error, match=message):
            await role.remote_send(RemoteSend("g-2", PROMPT, END, nodes.window(res)))
        with pytest.raises(error, match=message):
            await role.remote_send_overlapped(OverlappedSend("g-3", PROMPT, END))
        gates.open("prefill", "g-1")
        gates.open("kv_write", "g-1")
        assert (await within(first)).num_tokens_sent == END
        assert not role.busy() and len(nodes.p_agent.writes) == 1
        await nodes.unreserve("g-1")

    asyncio.run(go())


def test_failed_write_becomes_peer_unavailable_releases_pages_and_leaves_no_state(nodes):
    async def go():
        role = nodes.role()
        res = await nodes.reserve("f")
        before = await kv_of(nodes.decode)
        nodes.p_agent.fail_next_write("link down")
        with pytest.raises(PeerUnavailable, match="KV write failed: .*link down"):
            await within(role.remote_send(RemoteSend("f", PROMPT, END, nodes.window(res))))
        assert await free_pages(nodes.prefill) == (P_PAGES, P_PAGES)
        assert role.load().remote_sends_total == 0 and not role.busy()
        # the write began: no no-write promise can be given, and no KV-ready tag either
        await drained(role)
        assert nodes.d_agent.take_notifications() == [] and nodes.d_agent.received == []
        assert torch.equal(await kv_of(nodes.decode), before)

        retry = nodes.role()  # a retry of the same request id then goes through
        assert (await within(retry.remote_send(
            RemoteSend("f", PROMPT, END, nodes.window(res))))).num_tokens_sent == END
        assert nodes.d_agent.take_notifications() == [
            ("prefill-agent", notification_tag("f", LEASE))]
        await nodes.unreserve("f")

    asyncio.run(go())

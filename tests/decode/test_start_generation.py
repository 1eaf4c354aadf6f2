"""StartGeneration after a remote prefill, and its refusals.

The set-up, and how a phase is reached without waiting for time: tests/decode/world.py.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.decode.leases import LeaseError
from pdserve.decode.role import KVNotArrived, KVNotWritten, StartGeneration
from pdserve.kvtransfer.metadata import decode_append_metadata
from pdserve.proto.tags import no_write_tag
from pdserve.runtime.errors import status_of
from tests.decode.world import (
    END,
    PAGE,
    PAGES,
    RESERVED_PAGES,
    SHORT_S,
    collect,
    free_pages,
    prepare,
    quarantine_ended,
    start,
    tokens_of,
    within,
)

# ---- StartGeneration after a remote prefill ---------------------------------------------

def test_start_generation_waits_for_the_kv_notification_then_streams_like_a_colocated_engine(node):
    async def go():
        role = node.role()
        expected = await node.colocated()
        prepared = await role.prepare_receive(prepare("r", end=-1))
        lease = prepared.lease
        assert (lease.kv_window_end, lease.prefix_matched_length) == (END, 0)
        assert len(decode_append_metadata(prepared.kv_append_metadata)) == END
        assert await free_pages(node.decode) == PAGES - RESERVED_PAGES
        assert role.load().num_parked == 1 and role.busy()

        stream = asyncio.ensure_future(collect(role.start_generation(start(prepared))))
        await node.polled(2)  # the pump polled twice and found nothing: still waiting
        assert not stream.done()
        assert role.load().num_running == 1 and role.load().num_parked == 0
        await node.write_kv(prepared)
        outs = await within(stream)
        assert tokens_of(outs) == expected
        assert [t for o in outs for t in o.outputs[0].new_token_ids] == expected
        load = role.load()
        assert (load.num_running, load.num_parked, load.num_quarantined, load.requests_total) == \
            (0, 0, 0, 1)
        assert not role.busy()

    asyncio.run(go())


def test_kv_notification_that_arrives_before_start_generation_is_kept_for_it(node):
    async def go():
        role = node.role()
        expected = await node.colocated()
        prepared = await role.prepare_receive(prepare("r"))
        await node.write_kv(prepared)  # lands, and tags, before anyone waits
        outs = await within(collect(role.start_generation(start(prepared))))
        assert tokens_of(outs) == expected

    asyncio.run(go())


def test_kv_notification_taken_while_another_request_waits_is_kept_for_its_own_start(node):
    """The pump takes every notification while anyone waits: one for a request whose
    StartGeneration has not come yet must be kept for it, not dropped."""
    async def go():
        role = node.role()  # a lost tag fails at the default notification timeout
        expected = await node.colocated()
        waiting = await role.prepare_receive(prepare("a"))
        later = await role.prepare_receive(prepare("b"))
        stream_a = asyncio.ensure_future(collect(role.start_generation(start(waiting))))
        await node.polled(1)
        await node.write_kv(later)  # b's tag arrives while only a waits...
        await node.polled(2)        # ...and the pump has taken it
        assert not stream_a.done()
        assert tokens_of(await within(collect(role.start_generation(start(later))))) == expected
        await node.write_kv(waiting)
        assert tokens_of(await within(stream_a)) == expected

    asyncio.run(go())


def test_received_kv_after_a_local_prefix_match_generates_colocated_tokens(node):
    """A second request with the same prompt: the decode node's own prefix cache covers
    part of the prompt, so only [matched, end) is reserved and written."""
    async def go():
        role = node.role()
        expected = await node.colocated()
        first = await role.prepare_receive(prepare("r1"))
        await node.write_kv(first)
        assert tokens_of(await within(collect(role.start_generation(start(first))))) == expected
        second = await role.prepare_receive(prepare("r2"))
        matched = second.lease.prefix_matched_length
        assert matched == ((END - 1) // PAGE) * PAGE
        assert len(decode_append_metadata(second.kv_append_metadata)) == END - matched
        assert role.load().prefix_hit_tokens_total == matched
        await node.write_kv(second)
        assert tokens_of(await within(collect(role.start_generation(start(second))))) == expected

    asyncio.run(go())


# ---- StartGeneration refusals ------------------------------------------------------------

def test_start_generation_with_a_wrong_window_begin_is_refused_and_keeps_the_reservation(node):
    async def go():
        role = node.role()
        prepared = await role.prepare_receive(prepare("r"))
        with pytest.raises(ValueError, match=f"kv_window_begin 5 must equal the reserved "
                                             f"kv_window_end {END}"):
            await collect(role.start_generation(start(prepared, begin=5)))
        assert role.load().num_parked == 1 and role.load().num_quarantined == 0
        assert await free_pages(node.decode) == PAGES - RESERVED_PAGES
        assert await role.abort("r", settled=True)

    asyncio.run(go())


@pytest.mark.parametrize("case", ["wrong-lease", "unknown-request", "already-started"])
def test_start_generation_without_a_matching_live_lease_raises_lease_error(node, case):
    async def go():
        role = node.role()
        prepared = await role.prepare_receive(prepare("r"))
        lease = prepared.lease
        if case == "wrong-lease":
            req, code = StartGeneration("r", "not-" + lease.lease_id, END, True), \
                grpc.StatusCode.FAILED_PRECONDITION
        elif case == "unknown-request":
            req, code = StartGeneration("other", lease.lease_id, END, True), \
                grpc.StatusCode.NOT_FOUND
        else:
            await node.write_kv(prepared)
            await within(collect(role.start_generation(start(prepared))))
            req, code = start(prepared), grpc.StatusCode.NOT_FOUND
        with pytest.raises(LeaseError) as err:
            await collect(role.start_generation(req))
        assert err.value.code == code and status_of(err.value) == code
        assert err.value.missing == (code == grpc.StatusCode.NOT_FOUND)
        if case != "already-started":
            assert role.load().num_parked == 1  # the real reservation is untouched
            assert await role.abort("r", settled=True)

    asyncio.run(go())


@pytest.mark.parametrize("bound", ["node-config", "call-deadline"])
def test_kv_that_does_not_arrive_in_time_raises_kv_not_arrived_and_quarantines(node, bound):
    async def go():
        if bound == "node-config":
            role = node.role(notification_timeout_s=SHORT_S)
            req_timeout = None
        else:
            role = node.role()  # 10 s, cut by the call's deadline
            req_timeout = SHORT_S
        prepared = await role.prepare_receive(prepare("r"))
        with pytest.raises(KVNotArrived, match=f"did not arrive within {SHORT_S:g}s") as err:
            await within(collect(role.start_generation(start(prepared, timeout_s=req_timeout))))
        assert status_of(err.value) == grpc.StatusCode.DEADLINE_EXCEEDED
        # The prefill node may still be writing: the pages are held, not freed.
        assert role.load().num_quarantined == 1 and not role.busy()
        assert await free_pages(node.decode) == PAGES - RESERVED_PAGES
        node.post(no_write_tag("r", prepared.lease.lease_id))
        await quarantine_ended(role)
        assert await free_pages(node.decode) == PAGES
        assert role.load().num_quarantined == 0 and role.load().late_writes_total == 0

    asyncio.run(go())


@pytest.mark.parametrize("when", ["before-start", "while-waiting"])
def test_no_write_notice_raises_kv_not_written_and_frees_pages_at_once(node, when):
    async def go():
        role = node.role()
        prepared = await role.prepare_receive(prepare("r"))
        tag = no_write_tag("r", prepared.lease.lease_id)
        if when == "before-start":
            node.post(tag)
            stream = asyncio.ensure_future(collect(role.start_generation(start(prepared))))
        else:
            stream = asyncio.ensure_future(collect(role.start_generation(start(prepared))))
            await node.polled(2)
            assert not stream.done()
            node.post(tag)
        with pytest.raises(KVNotWritten, match="did not write the KV of request 'r'") as err:
            await within(stream)
        assert status_of(err.value) == grpc.StatusCode.FAILED_PRECONDITION
        assert await free_pages(node.decode) == PAGES  # already freed when the error came
        assert role.load().num_quarantined == 0 and not role.busy()

    asyncio.run(go())

"""Aborts, lease expiry and the quarantine of pages a late write may hit.

The set-up, and how a phase is reached without waiting for time: tests/decode/world.py.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

import pdserve.decode.quarantine
from pdserve.decode.leases import LeaseError
from pdserve.engine import SamplingParams
from pdserve.proto.tags import no_write_tag, notification_tag
from pdserve.runtime.errors import RequestAborted
from tests.decode.world import (
    PAGES,
    RESERVED_PAGES,
    collect,
    expired,
    free_pages,
    prepare,
    quarantine_ended,
    start,
    tokens_of,
    within,
)
from tests.fake_clock import FakeClock

# ---- aborts, expiry and the quarantine ---------------------------------------------------

@pytest.mark.parametrize("how", ["settled", "unsettled-then-late-write", "unsettled-then-no-write"])
def test_abort_of_a_parked_reservation_frees_it_only_when_no_write_can_come(node, how):
    async def go():
        role = node.role()
        prepared = await role.prepare_receive(prepare("r"))
        lease = prepared.lease
        assert await role.abort("r", settled=how == "settled") is True
        assert role.load().num_parked == 0 and not role.busy()
        if how == "settled":
            assert await free_pages(node.decode) == PAGES
            assert role.load().num_quarantined == 0
            return
        assert role.load().num_quarantined == 1
        await node.polled(2)  # the quarantine is waiting for a notification...
        assert await free_pages(node.decode) == PAGES - RESERVED_PAGES  # ...holding the pages
        if how == "unsettled-then-late-write":
            await node.write_kv(prepared)  # lands in pages nobody else was given
        else:
            node.post(no_write_tag("r", lease.lease_id))
        await quarantine_ended(role)
        assert await free_pages(node.decode) == PAGES
        load = role.load()
        assert load.num_quarantined == 0
        assert load.late_writes_total == (1 if how == "unsettled-then-late-write" else 0)

    asyncio.run(go())


@pytest.mark.parametrize("settled", [True, False], ids=["settled", "unsettled"])
def test_abort_while_waiting_for_kv_ends_the_wait_and_frees_or_quarantines(node, settled):
    async def go():
        role = node.role()
        prepared = await role.prepare_receive(prepare("r"))
        stream = asyncio.ensure_future(collect(role.start_generation(start(prepared))))
        await node.polled(1)
        assert await role.abort("r", settled=settled) is True
        with pytest.raises(RequestAborted, match="'r' was aborted"):
            await within(stream)
        if settled:
            assert await free_pages(node.decode) == PAGES
            assert role.load().num_quarantined == 0
        else:
            assert role.load().num_quarantined == 1
            assert await free_pages(node.decode) == PAGES - RESERVED_PAGES
            await node.write_kv(prepared)
            await quarantine_ended(role)
            assert await free_pages(node.decode) == PAGES
            assert role.load().late_writes_total == 1
        assert not role.busy()

    asyncio.run(go())


def test_caller_going_away_while_waiting_for_kv_quarantines_the_reservation(node):
    async def go():
        role = node.role()
        prepared = await role.prepare_receive(prepare("r"))
        stream = asyncio.ensure_future(collect(role.start_generation(start(prepared))))
        await node.polled(1)
        stream.cancel()
        with pytest.raises(asyncio.CancelledError):
            await within(stream)
        assert role.load().num_quarantined == 1 and role.load().num_running == 0
        assert await free_pages(node.decode) == PAGES - RESERVED_PAGES
        node.post(no_write_tag("r", prepared.lease.lease_id))
        await quarantine_ended(role)
        assert await free_pages(node.decode) == PAGES

    asyncio.run(go())


def test_abort_while_streaming_ends_the_stream_and_frees_the_pages(node):
    async def go():
        role = node.role()
        long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        prepared = await role.prepare_receive(prepare("r", params=long))
        await node.write_kv(prepared)
        outs = []
        async for out in role.start_generation(start(prepared)):
            outs.append(out)
            if len(outs) == 1:
                assert await role.abort("r") is True
        assert outs[-1].finished and outs[-1].finish_reason == "abort"
        assert len(outs[-1].token_ids) < 400
        assert await free_pages(node.decode) == PAGES and role.load().num_quarantined == 0

    asyncio.run(go())


def test_lease_expiry_quarantines_the_reservation_instead_of_freeing_it(node):
    async def go():
        role = node.role()
        prepared = await role.prepare_receive(prepare("r"))
        lease = prepared.lease
        await expired(role, lease)
        load = role.load()
        assert (load.num_parked, load.leases_expired_total, load.num_quarantined) == (0, 1, 1)
        assert await free_pages(node.decode) == PAGES - RESERVED_PAGES
        with pytest.raises(LeaseError) as err:
            await collect(role.start_generation(start(prepared)))
        assert err.value.code == grpc.StatusCode.NOT_FOUND
        role.leases.expire(lease)  # a second expiry of the same lease does nothing
        assert role.leases.expired_total == 1
        await node.write_kv(prepared)  # the prefill node's late write
        await quarantine_ended(role)
        assert await free_pages(node.decode) == PAGES
        assert role.load().late_writes_total == 1

    asyncio.run(go())


@pytest.mark.parametrize("passed", [True, False], ids=["past-lease-end-plus-grace", "within-grace"])
def test_quarantine_holds_pages_until_lease_end_plus_grace(node, monkeypatch, passed):
    clock = FakeClock()
    monkeypatch.setattr(pdserve.decode.quarantine, "time", clock)

    async def go():
        role = node.role(lease_ms=30_000, quarantine_grace_ms=60_000)
        prepared = await role.prepare_receive(prepare("r"))
        # On the quarantine's clock the lease ended 1 s ago, and its 60 s of grace ended
        # 1 s ago too, or are still running (59 s left).
        clock.advance(91.0 if passed else 31.0)
        assert await role.abort("r") is True
        if passed:
            await quarantine_ended(role)  # at once: no wait is left
            assert await free_pages(node.decode) == PAGES
        else:
            await node.polled(2)
            assert role.load().num_quarantined == 1
            assert await free_pages(node.decode) == PAGES - RESERVED_PAGES
            node.post(no_write_tag("r", prepared.lease.lease_id))
            await quarantine_ended(role)
        assert role.load().late_writes_total == 0

    asyncio.run(go())


def test_stale_notification_releases_only_its_own_lease_of_a_retried_request_id(node):
    async def go():
        role = node.role()
        expected = await node.colocated()
        old = await role.prepare_receive(prepare("r"))
        assert await role.abort("r") is True  # quarantined
        new = await role.prepare_receive(prepare("r"))  # the router retries the request id
        assert new.lease.lease_id != old.lease.lease_id
        assert new.lease.engine_key != old.lease.engine_key
        assert await free_pages(node.decode) == PAGES - 2 * RESERVED_PAGES
        stream = asyncio.ensure_future(collect(role.start_generation(start(new))))
        await node.polled(1)
        node.post(notification_tag("r", old.lease.lease_id))  # the old reservation's late tag
        await quarantine_ended(role)
        assert role.load().late_writes_total == 1
        assert await free_pages(node.decode) == PAGES - RESERVED_PAGES
        await node.polled(2)
        assert not stream.done()  # the new reservation still waits for its own tag
        await node.write_kv(new)
        assert tokens_of(await within(stream)) == expected

    asyncio.run(go())


def test_settled_abort_right_after_an_unsettled_one_frees_the_pages_at_once(node):
    async def go():
        role = node.role()
        prepared = await role.prepare_receive(prepare("r"))
        lease_id = prepared.lease.lease_id
        assert await role.abort("r") is True                 # quarantined, may be written
        assert await role.abort("r", settled=True, lease_id=lease_id)  # no write can come
        # A settled release takes one engine round trip; half a second is "at once" here
        # (a quarantine that missed the settle waits for the lease end plus 5 s of grace).
        await asyncio.wait(list(role.quarantine._tasks), timeout=0.5)
        settled = role.load().num_quarantined == 0
        if not settled:  # clean up: the no-write notice ends the watch
            node.post(no_write_tag("r", prepared.lease.lease_id))
            await quarantine_ended(role)
        assert settled, "the quarantine ignored the settled abort"

    asyncio.run(go())


def test_settled_abort_of_a_waiting_quarantine_frees_its_pages(node):
    async def go():
        role = node.role()
        prepared = await role.prepare_receive(prepare("r"))
        assert await role.abort("r") is True
        await node.polled(1)  # the quarantine's watch waits for a notification
        assert await free_pages(node.decode) == PAGES - RESERVED_PAGES
        lease_id = prepared.lease.lease_id
        assert await role.abort("r", settled=True, lease_id=lease_id) is True
        await quarantine_ended(role)
        assert await free_pages(node.decode) == PAGES
        assert role.load().late_writes_total == 0
        assert await role.abort("r", settled=True, lease_id=lease_id) is False  # nothing left
        assert prepared.lease.request_id == "r"

    asyncio.run(go())


def test_a_settled_abort_naming_no_lease_leaves_a_quarantined_reservation_held(node):
    """A request's first attempt is quarantined (its writer may still write); its retry
    then ends with a RemoteSend the prefill node answered, and the router's closing Abort
    says "settled". That word covers the retry only: the first writer's pages stay held."""
    async def go():
        role = node.role()
        first = await role.prepare_receive(prepare("r"))
        assert await role.abort("r", lease_id=first.lease.lease_id) is True  # quarantined
        await node.polled(1)
        assert await role.abort("r", settled=True) is False
        await node.polled(2)
        assert role.load().num_quarantined == 1
        assert await free_pages(node.decode) == PAGES - RESERVED_PAGES
        await node.write_kv(first)  # the first writer's late write lands in held pages
        await quarantine_ended(role)
        assert await free_pages(node.decode) == PAGES
        assert role.load().late_writes_total == 1

    asyncio.run(go())


def test_an_abort_naming_an_older_lease_leaves_the_newer_reservation_alone(node):
    """A router retries on the same node with the same request id; its Abort of the first
    reservation, landing late, must not free the second, which a prefill node may be
    writing (the pages would go to another request under the write)."""
    async def go():
        role = node.role()
        first = await role.prepare_receive(prepare("r"))
        assert await role.abort("r", settled=False, lease_id=first.lease.lease_id) is True
        second = await role.prepare_receive(prepare("r"))
        old = first.lease.lease_id
        assert await role.abort("r", settled=False, lease_id=old) is False  # the late Abort
        assert role.load().num_parked == 1 and role.load().num_quarantined == 1
        # Settled, it releases only the first reservation's quarantine.
        assert await role.abort("r", settled=True, lease_id=old) is True
        await quarantine_ended(role)
        assert role.load().num_parked == 1  # the second reservation is untouched...
        await node.write_kv(second)
        outs = await collect(role.start_generation(start(second)))
        assert tokens_of(outs)  # ...and generates
        assert await free_pages(node.decode) == PAGES

    asyncio.run(go())

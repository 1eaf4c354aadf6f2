"""Reservation leases: freed exactly once, by StartGeneration, Abort or expiry."""

import asyncio

import pytest

from pdserve.decode.leases import LeaseError, LeaseTable

INFO = dict(prompt_len=10, prefix_matched_length=0, kv_window_end=9)


def test_unclaimed_lease_expires_and_is_freed_once():
    async def go():
        expired = []

        async def on_expire(lease):
            expired.append(lease.request_id)

        table = LeaseTable(on_expire)
        table.grant("r", 0.05, **INFO)
        await asyncio.sleep(0.2)
        return table, expired

    table, expired = asyncio.run(go())
    assert expired == ["r"] and table.expired_total == 1 and "r" not in table


def test_taken_lease_never_expires_and_stale_lease_ids_are_refused():
    async def go():
        expired = []

        async def on_expire(lease):
            expired.append(lease.request_id)

        table = LeaseTable(on_expire)
        lease = table.grant("r", 0.05, **INFO)
        with pytest.raises(LeaseError) as wrong:
            table.take("r", "not-the-lease")
        assert not wrong.value.missing
        assert table.take("r", lease.lease_id) is lease
        with pytest.raises(LeaseError) as gone:
            table.take("r", lease.lease_id)
        assert gone.value.missing
        await asyncio.sleep(0.2)
        return expired

    assert asyncio.run(go()) == []

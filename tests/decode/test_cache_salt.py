"""The decode role matches and publishes a request's pages under its cache salt: a local
prefill under one salt is a hit for a reservation under that salt only."""

from __future__ import annotations

import asyncio
import dataclasses

from pdserve.decode.role import LocalPrefill
from tests.decode.world import END, GREEDY, PAGE, PROMPT, collect, prepare, within


def test_reservations_match_only_pages_cached_under_their_salt(node):
    async def go():
        role = node.role()
        outs = await within(collect(role.generate_local(
            LocalPrefill("victim", PROMPT, GREEDY, cache_salt="alice\x00"))))
        assert outs[-1].num_cached_tokens == 0
        matched = {}
        for salt in ("bob\x00", "", "alice\x00"):
            request = dataclasses.replace(prepare(f"r-{len(matched)}"), cache_salt=salt)
            prepared = await role.prepare_receive(request)
            matched[salt] = prepared.lease.prefix_matched_length
            assert await role.abort(request.request_id, settled=True)  # no write was coming
        assert matched == {"bob\x00": 0, "": 0, "alice\x00": (END - 1) // PAGE * PAGE}

    asyncio.run(go())

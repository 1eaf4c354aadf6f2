"""Test gates: a gated request stops at its phase until opened; others never stop."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.runtime.gates import Gates


def test_a_gated_request_stops_until_its_gate_opens_and_leaves_nothing_behind():
    async def go():
        gates = Gates("slow-")
        passed = asyncio.ensure_future(gates.passage("prefill", "slow-1"))
        await asyncio.wait_for(gates.reached("prefill", "slow-1"), 5)
        assert not passed.done()
        gates.open("prefill", "slow-1")
        await asyncio.wait_for(passed, 5)
        return gates

    gates = asyncio.run(go())
    assert not gates._reached and not gates._opened


def test_a_gate_opened_first_lets_the_request_pass_and_other_ids_never_stop():
    async def go():
        gates = Gates("slow-")
        gates.open("kv_write", "slow-2")
        await asyncio.wait_for(gates.passage("kv_write", "slow-2"), 5)
        await asyncio.wait_for(gates.passage("kv_write", "fast-1"), 5)

    asyncio.run(go())


def test_gates_need_a_prefix():
    with pytest.raises(ValueError):
        Gates("")

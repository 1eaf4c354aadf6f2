"""A freed reservation whose writer is named comes back only on proof that no write can
land: the writer's answer to FenceWrites, its death, or its notification; never because a
clock says the lease is long over. A writer silent past lease + grace is fenced (listed,
its pages counted) until it answers. The FenceWrites call itself is not what these tests
are about: `quarantine.ask` is a scripted stand-in for decode/fence.py's `ask_writer`."""

from __future__ import annotations

import asyncio

import pytest

import pdserve.decode.quarantine
from pdserve.decode.fence import Proof
from tests.decode.world import (PAGES, RESERVED_PAGES, WAIT_S, free_pages, prepare,
                                quarantine_ended, within)
from tests.fake_clock import FakeClock

WRITER = "prefill.invalid:50051"


class ScriptedWriter:
    """Answers the quarantine's questions with `answer`; counts them, so a test can wait
    for the n-th question (the quarantine acts on an answer before it asks again)."""

    def __init__(self, answer: Proof | None = None) -> None:
        self.answer = answer
        self.asked = 0
        self._asked = asyncio.Event()

    async def __call__(self, lease, timeout_s):
        assert lease.writer_address == WRITER
        self.asked += 1
        self._asked.set()
        return self.answer

    async def asked_at_least(self, n: int) -> None:
        async def wait():
            while self.asked < n:
                self._asked.clear()
                await self._asked.wait()
        await within(wait(), WAIT_S)


def _role(node, writer: ScriptedWriter):
    role = node.role(lease_ms=30_000, quarantine_grace_ms=5_000)
    role.quarantine.ask = writer
    return role


def test_silent_writer_is_fenced_past_lease_and_grace_and_released_when_it_answers(
        node, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(pdserve.decode.quarantine, "time", clock)
    writer = ScriptedWriter(None)

    async def go():
        role = _role(node, writer)
        prepared = await role.prepare_receive(prepare("r", writer_address=WRITER))
        assert await role.abort("r") is True  # unsettled: a write may still come
        await writer.asked_at_least(2)
        assert role.load().fenced_writers == []  # asked, not yet past lease + grace
        clock.advance(3600.0)  # an hour on: still no page comes back on a clock's word
        await writer.asked_at_least(writer.asked + 2)  # one whole silent answer since
        assert role.load().fenced_writers == [WRITER]
        assert role.load().fenced_pages == RESERVED_PAGES
        assert await free_pages(node.decode) == PAGES - RESERVED_PAGES
        writer.answer = Proof.CONFIRMED
        await quarantine_ended(role)
        assert await free_pages(node.decode) == PAGES
        load = role.load()
        assert load.fenced_writers == [] and load.fenced_pages == 0
        assert load.late_writes_total == 0 and prepared.lease.writer_address == WRITER

    asyncio.run(go())


@pytest.mark.parametrize("proof", [Proof.GONE, Proof.CONFIRMED, Proof.WROTE])
def test_writers_answer_or_death_releases_at_once_well_before_the_lease_ends(node, proof):
    writer = ScriptedWriter(proof)

    async def go():
        role = _role(node, writer)
        await role.prepare_receive(prepare("r", writer_address=WRITER))
        assert await role.abort("r") is True
        await quarantine_ended(role)  # the lease has 30 s left
        assert await free_pages(node.decode) == PAGES
        assert role.load().late_writes_total == (1 if proof is Proof.WROTE else 0)

    asyncio.run(go())


def test_the_writers_notification_releases_while_it_does_not_answer(node):
    writer = ScriptedWriter(None)

    async def go():
        role = _role(node, writer)
        prepared = await role.prepare_receive(prepare("r", writer_address=WRITER))
        assert await role.abort("r") is True
        await writer.asked_at_least(1)
        await node.write_kv(prepared)  # it was only slow: its write lands
        await quarantine_ended(role)
        assert await free_pages(node.decode) == PAGES
        assert role.load().late_writes_total == 1

    asyncio.run(go())

"""The `nodes` fixture of these tests (tests/prefill/world.py has the rest)."""

from __future__ import annotations

import asyncio

import pytest

from tests.prefill.world import Nodes, free_pages


@pytest.fixture
def nodes(tiny_model):
    n = Nodes(tiny_model)
    yield n
    for role in n.roles:
        role.close()

    async def pools():
        return [await free_pages(e) for e in n.engines]

    try:
        leftover = asyncio.run(pools())
    finally:
        for engine in n.engines:
            engine.shutdown()
    assert all(free == total for free, total in leftover), f"pages leaked: {leftover}"

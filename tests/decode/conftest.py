"""The `node` fixture of these tests (tests/decode/world.py has the rest)."""

from __future__ import annotations

import asyncio

import pytest

from tests.decode.world import PAGES, Node, free_pages


@pytest.fixture
def node(tiny_model):
    n = Node(tiny_model)
    yield n
    for role in n.roles:
        role.close()

    async def pools():
        return [(await free_pages(e), PAGES) for e in n.engines]

    try:
        leftover = asyncio.run(pools())
    finally:
        for engine in n.engines:
            engine.shutdown()
    assert all(free == total for free, total in leftover), f"pages leaked: {leftover}"

"""A node's port is its own while it lives: a second server (even one that asks for
SO_REUSEPORT, as gRPC does by default) cannot bind it. The decode node takes an answer at
a writer's address as the writer's word (decode/fence.py), so no process may answer there
while a frozen writer still holds the port."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.runtime.server import new_server


def test_a_second_server_cannot_take_a_live_nodes_port():
    async def go():
        node = new_server()
        port = node.add_insecure_port("127.0.0.1:0")
        await node.start()
        try:
            for other in (new_server(), grpc.aio.server()):
                with pytest.raises(RuntimeError, match=f"Failed to bind to address 127.0.0.1:{port}"):
                    other.add_insecure_port(f"127.0.0.1:{port}")
        finally:
            await node.stop(None)
        after = new_server()  # once the node is gone, its port is free again
        assert after.add_insecure_port(f"127.0.0.1:{port}") == port

    asyncio.run(go())

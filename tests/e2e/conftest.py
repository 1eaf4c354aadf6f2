"""Session fixtures: a tiny checkpoint, a disaggregated cluster (router + prefill + decode)
and a colocated node, all as separate processes on loopback, killed at the end."""

from __future__ import annotations

import asyncio

import pytest

from tests.e2e.procs import WORKER_FLAGS, Node




@pytest.fixture(scope="session")
def cluster(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    nodes = []
    try:
        for role in ("prefill", "decode"):  # start both, then wait: their start-ups overlap
            nodes.append(Node([role, "--model", tiny_model, "--host", "127.0.0.1", "--port", "0",
                               *WORKER_FLAGS], logs / f"{role}.log", wait=False))
        prefill, decode = (node.wait_ready() for node in nodes)
        router = Node(["router", "--model", tiny_model, "--host", "127.0.0.1", "--port", "0",
                       "--prefill", prefill.address, "--decode", decode.address], logs / "router.log")
        nodes.append(router)
        yield {"router": router, "prefill": prefill, "decode": decode}
    finally:
        for node in reversed(nodes):
            node.stop()


@pytest.fixture(scope="session")
def colocated(tiny_model, tmp_path_factory):
    node = Node(["serve", "--model", tiny_model, "--host", "127.0.0.1", "--port", "0",
                 *WORKER_FLAGS], tmp_path_factory.mktemp("logs-both") / "both.log")
    try:
        yield node
    finally:
        node.stop()


def run(coro, timeout_s: float = 120.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))

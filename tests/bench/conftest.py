"""A tiny disaggregated cluster (router + prefill + decode) on loopback for the benchmark's
smoke test: real processes, one torch thread each, killed at the end."""

from __future__ import annotations

import pytest

from tests.e2e.procs import WORKER_FLAGS, Node


@pytest.fixture(scope="session")
def tiny_cluster(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("bench-logs")
    nodes = []
    try:
        for role in ("prefill", "decode"):  # start both, then wait: their start-ups overlap
            nodes.append(Node([role, "--model", tiny_model, "--host", "127.0.0.1",
                               "--port", "0", *WORKER_FLAGS], logs / f"{role}.log", wait=False))
        prefill, decode = (node.wait_ready() for node in nodes)
        nodes.append(Node(["router", "--model", tiny_model, "--host", "127.0.0.1",
                           "--port", "0", "--prefill", prefill.address, "--decode", decode.address],
                          logs / "router.log"))
        yield nodes[-1].address
    finally:
        for node in reversed(nodes):
            node.stop()

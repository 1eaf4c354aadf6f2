"""Fault-test fixtures: a tiny checkpoint and one shared cluster (tests/faults/cluster.py).

Tests that kill a node restart it on the same port before they end, so every test starts
from a whole cluster; each test checks the pools of the nodes it touched are full again.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.faults.cluster import Cluster


@pytest.fixture(scope="session")
def fault_model(tiny_model) -> str:
    return tiny_model


@pytest.fixture(scope="session")
def fault_cluster(fault_model, tmp_path_factory):
    cluster = Cluster(fault_model, tmp_path_factory.mktemp("fault-logs"))
    try:
        yield cluster
    finally:
        cluster.stop()


def run(coro, timeout_s: float = 120.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))

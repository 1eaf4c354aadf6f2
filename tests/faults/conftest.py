"""Fault-test fixtures: a tiny checkpoint and one shared cluster (tests/faults/cluster.py).

Tests that kill a node restart it on the same port before they end, so every test starts
from a whole cluster; each test checks the pools of the nodes it touched are full again.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.faults.cluster import Cluster


@pytest.fixture(scope="session")
def fault_model(tmp_path_factory):
    from engine.checkpoint import write_checkpoint

    path = tmp_path_factory.mktemp("fault-llama")
    write_checkpoint(path, family="llama", seed=0, vocab_size=512, hidden_size=64,
                     intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=512)
    return str(path)


@pytest.fixture(scope="session")
def fault_cluster(fault_model, tmp_path_factory):
    cluster = Cluster(fault_model, tmp_path_factory.mktemp("fault-logs"))
    try:
        yield cluster
    finally:
        cluster.stop()


def run(coro, timeout_s: float = 120.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))

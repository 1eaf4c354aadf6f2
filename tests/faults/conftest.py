"""Fault-test fixtures: one shared cluster serving the tiny checkpoint (tests/faults/cluster.py).

Tests that kill a node restart it on the same port before they end, so every test starts
from a whole cluster; each test checks the pools of the nodes it touched are full again.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import run  # noqa: F401  (the tests here import it from this module)
from tests.faults.cluster import Cluster


@pytest.fixture(scope="session")
def fault_cluster(tiny_model, tmp_path_factory):
    cluster = Cluster(tiny_model, tmp_path_factory.mktemp("fault-logs"))
    try:
        yield cluster
    finally:
        cluster.stop()

"""Fixtures for the deployment tests: the tiny checkpoint that stands in for the model
volume, and the compose services running as local processes (see compose_local.py)."""

from __future__ import annotations

import pytest

from tests.deploy.compose_local import LocalCompose

# Compose variables, as a user would put them in `.env`: the model directory to mount, and
# small settings for a shared two-core machine.
VARIABLES = {"NUM_THREADS": "1", "KV_CACHE_MB": "16"}




@pytest.fixture(scope="session")
def compose(tiny_model, tmp_path_factory):
    stack = LocalCompose({**VARIABLES, "MODEL_DIR": tiny_model}, tmp_path_factory.mktemp("compose"))
    try:
        stack.up()
        yield stack
    finally:
        stack.down()

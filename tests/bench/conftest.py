"""A tiny disaggregated cluster (router + prefill + decode) on loopback for the benchmark's
smoke test: real processes, one torch thread each, killed at the end."""

from __future__ import annotations

import pytest

from tests.e2e.procs import WORKER_FLAGS, Node

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    from engine.checkpoint import write_checkpoint

    path = tmp_path_factory.mktemp("bench-tiny-llama")
    write_checkpoint(path, family="llama", seed=0, **TINY)
    return str(path)


@pytest.fixture(scope="session")
def tiny_cluster(tiny_checkpoint, tmp_path_factory):
    logs = tmp_path_factory.mktemp("bench-logs")
    nodes = []
    try:
        for role in ("prefill", "decode"):  # start both, then wait: their start-ups overlap
            nodes.append(Node([role, "--model", tiny_checkpoint, "--host", "127.0.0.1",
                               "--port", "0", *WORKER_FLAGS], logs / f"{role}.log", wait=False))
        prefill, decode = (node.wait_ready() for node in nodes)
        nodes.append(Node(["router", "--model", tiny_checkpoint, "--host", "127.0.0.1",
                           "--port", "0", "--prefill", prefill.address, "--decode", decode.address],
                          logs / "router.log"))
        yield nodes[-1].address
    finally:
        for node in reversed(nodes):
            node.stop()

"""`host_id`: which nodes share memory for KV (whole-window sends) and which talk over a
network link (layer-wise sends under `--kv-send auto`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdserve.runtime.identity import host_id, ucx_moves_gpu_memory


def test_processes_sharing_memory_have_one_id_keyed_by_the_ipc_namespace(monkeypatch):
    monkeypatch.delenv("UCX_TLS", raising=False)
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    ipc = os.stat("/proc/self/ns/ipc").st_ino
    assert host_id() == f"{boot}/ipc:{ipc}"
    monkeypatch.setenv("UCX_TLS", "^cma")  # all but CMA: shared memory still
    assert host_id() == f"{boot}/ipc:{ipc}"


@pytest.mark.parametrize("tls", ["tcp", "tcp,self", "rc,ud"])
def test_a_node_whose_ucx_has_only_network_transports_is_its_network_namespace(monkeypatch, tls):
    monkeypatch.setenv("UCX_TLS", tls)
    net = os.stat("/proc/self/ns/net").st_ino
    assert host_id().endswith(f"/net:{net}") and host_id() != ""


@pytest.mark.parametrize("tls, moves", [(None, True), ("all", True), ("tcp,cuda_copy,cuda_ipc", True),
                                        ("sm,cuda", True), ("^tcp", True), ("tcp", False), ("sm,self", False),
                                        ("^cuda_copy", False)])
def test_a_gpu_node_can_tell_whether_ucx_tls_leaves_it_a_cuda_transport(monkeypatch, tls, moves):
    # A GPU node warns at start when it cannot: its every KV write would fail.
    if tls is None:
        monkeypatch.delenv("UCX_TLS", raising=False)
    else:
        monkeypatch.setenv("UCX_TLS", tls)
    assert ucx_moves_gpu_memory() is moves

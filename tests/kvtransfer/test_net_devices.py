"""UCX's devices follow the node's `--host` (kvtransfer/net_devices.py): loopback keeps it on
`lo`, a wildcard and an operator's own `UCX_NET_DEVICES` are left alone, and an address no
interface here owns changes nothing. That no listener leaks in a real node:
tests/cluster/test_transport.py."""

from __future__ import annotations

import os

import pytest

from pdserve.kvtransfer import net_devices
from pdserve.kvtransfer.net_devices import bind_to_host, interface_of


@pytest.fixture(autouse=True)
def no_ucx_devices(monkeypatch):
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    monkeypatch.setattr(net_devices, "rdma_ports", lambda: [])


def test_loopback_by_address_or_name_is_lo():
    assert interface_of("127.0.0.1") == interface_of("localhost") == "lo"
    assert interface_of("::1") == "lo"


def test_a_node_on_loopback_keeps_ucx_on_lo_and_its_rdma_ports(monkeypatch):
    assert bind_to_host("127.0.0.1") == "lo" == os.environ["UCX_NET_DEVICES"]
    monkeypatch.delenv("UCX_NET_DEVICES")
    monkeypatch.setattr(net_devices, "rdma_ports", lambda: ["mlx5_0:1"])
    assert bind_to_host("127.0.0.1") == "lo,mlx5_0:1"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.254", "no-such-host.invalid"])
def test_a_wildcard_or_an_address_no_interface_owns_leaves_ucx_alone(host, monkeypatch):
    if host == "192.0.2.254" and interface_of(host) is not None:
        pytest.skip("this machine owns the documentation address")
    assert bind_to_host(host) is None and "UCX_NET_DEVICES" not in os.environ


def test_an_operators_own_devices_are_kept(monkeypatch):
    monkeypatch.setenv("UCX_NET_DEVICES", "pd0")
    assert bind_to_host("127.0.0.1") == "pd0"

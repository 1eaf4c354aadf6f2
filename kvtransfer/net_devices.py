"""Which network devices NIXL's UCX may use: those of the address a node binds (`--host`).

UCX's TCP transport listens on every device it may use, so a node bound to 127.0.0.1
still had a UCX listener on the machine's outside interface. `bind_to_host(host)` sets
`UCX_NET_DEVICES` to the interface owning `host`, plus the machine's RDMA ports (they
open no TCP listener, and a TCP-only list would take RDMA away), before the agent
creates its UCX context (UCX reads its settings then). Invariants: an operator's own
`UCX_NET_DEVICES` is kept; a wildcard host (0.0.0.0, ::) leaves UCX on every device, as
the node's other ports are; a host no local interface owns (a NAT address) leaves UCX
alone and says so, rather than guess.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
from pathlib import Path

log = logging.getLogger("pdserve.kvtransfer")
SIOCGIFADDR = 0x8915
WILDCARDS = frozenset({"", "0.0.0.0", "::", "[::]"})


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:  # no IPv4 address on this interface
            return None
    return socket.inet_ntoa(packed[20:24])


def _ipv6_owners(address: ipaddress.IPv6Address) -> list[str]:
    path = Path("/proc/net/if_inet6")
    lines = path.read_text().splitlines() if path.exists() else []
    return [f[5] for f in (line.split() for line in lines)
            if len(f) == 6 and ipaddress.IPv6Address(int(f[0], 16)) == address]


def interface_of(host: str) -> str | None:
    """The local interface whose address is `host` (an IP or a name resolved here)."""
    try:
        address = ipaddress.ip_address(socket.gethostbyname(host) if ":" not in host
                                       else host.strip("[]"))
    except (OSError, ValueError):
        return None
    if address.version == 6:
        owners = _ipv6_owners(address)
        return owners[0] if owners else None
    if address.is_loopback:
        return "lo"
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == str(address):
            return name
    return None


def rdma_ports() -> list[str]:
    """UCX's names of this machine's RDMA ports (`mlx5_0:1`)."""
    root = Path("/sys/class/infiniband")
    if not root.is_dir():
        return []
    return sorted(f"{dev.name}:{port.name}" for dev in root.iterdir()
                  for port in (dev / "ports").iterdir() if (dev / "ports").is_dir())


def bind_to_host(host: str) -> str | None:
    """Set `UCX_NET_DEVICES` for a node bound to `host`; what it is now (None: unset)."""
    if os.environ.get("UCX_NET_DEVICES") or host in WILDCARDS:
        return os.environ.get("UCX_NET_DEVICES")
    device = interface_of(host)
    if device is None:
        log.warning("no local interface has address %s (--host): UCX listens on every "
                    "device; set UCX_NET_DEVICES to keep it on one", host)
        return None
    os.environ["UCX_NET_DEVICES"] = ",".join([device, *rdma_ports()])
    return os.environ["UCX_NET_DEVICES"]

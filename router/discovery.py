"""DNS discovery: a worker target `dns:///NAME:PORT` is one worker per address NAME has.

A decode node keeps a request's state between PrepareReceive and StartGeneration, so the
router must talk to each replica on its own channel: letting one gRPC channel balance
over a name could send the two calls to different replicas. Instead the router resolves
the name itself and registers one endpoint per address. That is what a scaled service
looks like from inside: docker compose's DNS answers a service name with one address per
running replica, and a Kubernetes headless Service answers with one per ready pod (so a
draining pod, whose health turned NOT_SERVING, drops out by itself).

Names are re-resolved every `interval_s`: new replicas are added, vanished ones removed.
A lookup that fails keeps that name's last addresses (a DNS hiccup must not empty the
pool). A plain HOST:PORT target is a single static endpoint, never resolved by us.
Discovery through a registry service (etcd) would update the same `WorkerRegistry`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Sequence

from pdserve.router.registry import WorkerRegistry

log = logging.getLogger("pdserve.router")

DNS_SCHEME = "dns:///"


def is_dns(target: str) -> bool:
    return target.startswith(DNS_SCHEME)


def _join(ip: str, port: str) -> str:
    return f"[{ip}]:{port}" if ipaddress.ip_address(ip).version == 6 else f"{ip}:{port}"


async def resolve(target: str) -> list[str]:
    """`dns:///decode:50062` -> ["172.18.0.5:50062", "172.18.0.6:50062"], sorted."""
    host, sep, port = target[len(DNS_SCHEME):].rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{target!r}: expected dns:///NAME:PORT")
    infos = await asyncio.get_running_loop().getaddrinfo(
        host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    return sorted({_join(info[4][0], port) for info in infos})


class DnsDiscovery:
    """Keeps `registry`'s endpoints equal to the static targets plus what the names resolve to."""

    def __init__(self, registry: WorkerRegistry, prefill: Sequence[str], decode: Sequence[str],
                 interval_s: float = 5.0) -> None:
        self.registry = registry
        self.targets = {"prefill": list(prefill), "decode": list(decode)}
        self.interval_s = interval_s
        self._last: dict[str, list[str]] = {}

    @property
    def needed(self) -> bool:
        return any(is_dns(t) for targets in self.targets.values() for t in targets)

    async def refresh(self) -> None:
        for role, targets in self.targets.items():
            addresses: list[str] = []
            for target in targets:
                if not is_dns(target):
                    addresses.append(target)
                    continue
                try:
                    self._last[target] = await resolve(target)
                except (OSError, ValueError) as err:
                    log.warning("cannot resolve %s worker %s: %s", role, target, err)
                addresses += self._last.get(target, [])
            await self.registry.set_addresses(role, list(dict.fromkeys(addresses)))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.refresh()

"""Membership in etcd: workers register themselves; routers read and watch the records.

Key: `<prefix>/<role>/<address>` (prefix default `/pdserve/workers`); value: one JSON
object, `WorkerRecord` (address, role, instance, and the `NodeIdentity` fields: model,
model hash, dtype, KV geometry). The key is attached to a lease of `ttl_s` seconds that the
worker keeps alive every `ttl_s / 3`; so a worker that dies disappears from etcd within
`ttl_s`, and one that drains revokes its lease first, so it disappears at once.

`instance` is unique per process start (the NIXL agent name): a node restarted on the same
address is a new instance, and routers drop whatever they believed about the old one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from dataclasses import dataclass

from pdserve.runtime.identity import NodeIdentity
from pdserve.runtime.options import option

log = logging.getLogger("pdserve.runtime.membership")

DEFAULT_PREFIX = "/pdserve/workers"


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """`"127.0.0.1:2379"` or `"http://host:2379"` -> (host, port)."""
    host, _, port = endpoint.split("://")[-1].rstrip("/").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"etcd endpoint must be HOST:PORT, got {endpoint!r}")
    return host.strip("[]"), int(port)


def advertised_address(host: str, port: int) -> str:
    """The address other nodes use to reach a server bound to `host`."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.gethostbyname(socket.gethostname())
    return f"{host}:{port}"


@dataclass(frozen=True)
class WorkerRecord:
    address: str
    role: str
    instance: str
    identity: NodeIdentity

    def key(self, prefix: str) -> str:
        return f"{prefix.rstrip('/')}/{self.role}/{self.address}"

    def to_json(self) -> bytes:
        return json.dumps({"address": self.address, "role": self.role,
                           "instance": self.instance, **self.identity.to_dict()}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "WorkerRecord":
        d = json.loads(raw)
        return cls(d["address"], d["role"], d.get("instance", ""), NodeIdentity.from_dict(d))


def new_client(endpoint: str, timeout_s: float = 5.0):
    import aetcd

    host, port = split_endpoint(endpoint)
    return aetcd.Client(host=host, port=port, timeout=timeout_s)


@dataclass
class MembershipConfig:
    """Where a worker registers itself; `etcd` empty: no registration."""

    etcd: str = option("", "register this node in etcd while it serves (default: no "
                           "registration)", metavar="HOST:PORT")
    etcd_prefix: str = option(DEFAULT_PREFIX, "key prefix of the registrations")
    etcd_ttl_s: int = option(5, "lease of the registration: a node that dies disappears "
                                "within this")
    advertise_address: str = option("", "address registered for other nodes to reach "
                                        "(default: --host and the bound port; the host's "
                                        "address when --host is 0.0.0.0)", metavar="HOST:PORT")

    def registration(self, record: "WorkerRecord") -> "Registration":
        return Registration(self.etcd, record, self.etcd_prefix, self.etcd_ttl_s)


class Registration:
    """A worker's record in etcd, kept alive by a lease until `withdraw`."""

    def __init__(self, endpoint: str, record: WorkerRecord, prefix: str = DEFAULT_PREFIX,
                 ttl_s: int = 5) -> None:
        self.endpoint = endpoint
        self.record = record
        self.key = record.key(prefix).encode()
        self.ttl_s = max(2, int(ttl_s))
        self._client = None
        self._lease = None
        self._keepalive: asyncio.Task | None = None

    async def start(self) -> None:
        self._client = new_client(self.endpoint)
        await self._register()
        self._keepalive = asyncio.create_task(self._keep_alive())
        log.info("registered %s in etcd at %s (lease %ss)", self.key.decode(), self.endpoint,
                 self.ttl_s)

    async def _register(self) -> None:
        self._lease = await self._client.lease(self.ttl_s)
        await self._client.put(self.key, self.record.to_json(), lease=self._lease)

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                reply = await self._lease.refresh()
                if reply is None or reply.TTL <= 0:  # expired (e.g. etcd was unreachable)
                    log.warning("etcd lease of %s expired; registering again", self.key.decode())
                    await self._register()
            except Exception as err:  # keep trying: etcd may come back within the TTL
                log.warning("etcd keepalive of %s failed: %s", self.key.decode(), err)

    async def withdraw(self) -> None:
        """Deregister now (drain, shutdown): revoking the lease deletes the key."""
        if self._keepalive is not None:
            self._keepalive.cancel()
            self._keepalive = None
        if self._client is None:
            return
        try:
            if self._lease is not None:
                await asyncio.wait_for(self._lease.revoke(), 3.0)
                log.info("deregistered %s from etcd", self.key.decode())
        except Exception as err:  # the lease still expires by itself within ttl_s
            log.warning("etcd deregistration of %s failed: %s", self.key.decode(), err)
        finally:
            self._lease = None
            client, self._client = self._client, None
            await client.close()

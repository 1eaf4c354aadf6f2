"""etcd discovery: the router's pools follow the worker records under a prefix, live.

Workers register `<prefix>/<role>/<address>` with a lease (pdserve/membership.py). The
router reads the prefix once, then watches it from the next revision: a PUT adds or
updates a node (a new `instance` on the same address resets what the router guessed about
it), a DELETE (lease expired: the worker died; or revoked: it drained) removes it. Each
change replaces the "etcd" part of the registry's pools (`WorkerRegistry.set_addresses`),
next to any static endpoints, and the registry admits or refuses the node by its identity.

If the watch breaks (etcd restarted, network), the router keeps its current pools, waits
`retry_s` and reads the prefix again, so it never works from a view older than one resync.
Nothing here is router-only state: every router watching the prefix sees the same pools.
"""

from __future__ import annotations

import asyncio
import logging

from pdserve.runtime.membership import DEFAULT_PREFIX, WorkerRecord, new_client
from pdserve.router.registry import WorkerRegistry

log = logging.getLogger("pdserve.router")

ROLES = ("prefill", "decode")


class EtcdDiscovery:
    def __init__(self, registry: WorkerRegistry, endpoint: str, prefix: str = DEFAULT_PREFIX,
                 retry_s: float = 1.0) -> None:
        self.registry = registry
        self.endpoint = endpoint
        self.prefix = prefix.rstrip("/") + "/"
        self.retry_s = retry_s
        self.records: dict[str, WorkerRecord] = {}  # etcd key -> record
        self._client = None

    async def _apply(self) -> None:
        for role in ROLES:
            records = [r for r in self.records.values() if r.role == role]
            await self.registry.set_addresses(
                role, [r.address for r in records], source="etcd",
                identities={r.address: (r.identity, r.instance) for r in records})

    def _put(self, key: bytes, value: bytes) -> None:
        try:
            record = WorkerRecord.from_json(value)
        except (ValueError, KeyError, TypeError) as err:
            log.warning("ignoring malformed worker record %s: %s", key.decode(errors="replace"), err)
            return
        if record.role not in ROLES:
            log.warning("ignoring worker record %s with role %r", key.decode(), record.role)
            return
        if key.decode() not in self.records:
            log.info("etcd: %s node %s joined", record.role, record.address)
        self.records[key.decode()] = record

    async def refresh(self) -> int:
        """Read every record under the prefix; returns the revision read at."""
        if self._client is None:
            self._client = new_client(self.endpoint)
        result = await self._client.get_prefix(self.prefix.encode())
        self.records.clear()
        for kv in result:
            self._put(kv.key, kv.value)
        await self._apply()
        return result.header.revision

    async def run(self, revision: int | None = None) -> None:
        """Watch forever (cancel to stop); `revision`: what `refresh` returned."""
        from aetcd.rtypes import EventKind

        while True:
            try:
                if revision is None:
                    revision = await self.refresh()
                watch = await self._client.watch_prefix(self.prefix.encode(),
                                                        start_revision=revision + 1)
                async for event in watch:
                    key = event.kv.key.decode()
                    if event.kind == EventKind.PUT:
                        self._put(event.kv.key, event.kv.value)
                    elif key in self.records:
                        record = self.records.pop(key)
                        log.info("etcd: %s node %s left", record.role, record.address)
                    await self._apply()
                raise ConnectionError("etcd watch ended")
            except asyncio.CancelledError:
                raise
            except Exception as err:
                log.warning("etcd discovery at %s: %s; reading the prefix again in %gs",
                            self.endpoint, err, self.retry_s)
                revision = None
                await self._close_client()
                await asyncio.sleep(self.retry_s)

    async def _close_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                await client.close()
            except Exception:
                pass

    async def close(self) -> None:
        await self._close_client()

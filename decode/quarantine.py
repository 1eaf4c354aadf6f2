"""Quarantine: freed reservations whose pages a prefill node may still write.

NIXL writes are one-sided: a prefill node that is slow, or whose RemoteSend the router gave
up on, can write into a reservation's slots after the reservation was aborted or its lease
ran out. If those pages went back to the pool, the write would land in another request's
KV. So a reservation freed before its KV arrived is held here, pages and all, until the
first of:
- its KV-ready notification (the writes have landed; counted in `late_writes_total`),
- the prefill node's no-write notice (it never began writing),
- a settled Abort (`settle`: the router knows no RemoteSend can still write),
- the lease's end plus `grace_s`: a prefill node never starts or continues a write past
  the lease's end (RemoteSendRequest.lease_expires_unix_ms, D's clock), so `grace_s` only
  has to cover clock skew between nodes and the cancellation of a write in progress.
Notifications carry the lease id, so a late one can only release its own reservation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from decode.inbox import Interrupted, NotificationInbox
from decode.leases import Lease
from proto.tags import no_write_tag, notification_tag

log = logging.getLogger("pdserve.decode")


class Quarantine:
    def __init__(self, inbox: NotificationInbox, free: Callable[[str], Awaitable[None]],
                 grace_s: float) -> None:
        self.inbox = inbox
        self.free = free  # frees the engine request of a reservation (by its engine key)
        self.grace_s = grace_s
        self._held: dict[str, Lease] = {}  # engine key -> lease
        self._settled: set[str] = set()  # engine keys settled before their watch began
        self._tasks: set[asyncio.Task] = set()
        self.late_writes_total = 0

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, lease: Lease) -> None:
        self._held[lease.engine_key] = lease
        task = asyncio.ensure_future(self._watch(lease))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def settle(self, request_id: str) -> bool:
        """Release every quarantined reservation of `request_id` now."""
        held = [lease for lease in self._held.values() if lease.request_id == request_id]
        for lease in held:
            self._settled.add(lease.engine_key)  # a watch that has not begun yet sees it
            self.inbox.interrupt(tags(lease), Interrupted.SETTLED)
        return bool(held)

    async def _watch(self, lease: Lease) -> None:
        kv_tag = notification_tag(lease.request_id, lease.lease_id)
        until = lease.expires_at + self.grace_s
        try:
            if lease.engine_key in self._settled:
                why = Interrupted.SETTLED
            else:
                why = await self.inbox.wait(tags(lease), until - time.monotonic())
            if why == kv_tag:
                self.late_writes_total += 1
                log.warning("late KV write for freed reservation %s landed in quarantine",
                            lease.engine_key)
            await self.free(lease.engine_key)
        finally:
            self._held.pop(lease.engine_key, None)
            self._settled.discard(lease.engine_key)


def tags(lease: Lease) -> tuple[bytes, bytes]:
    return (notification_tag(lease.request_id, lease.lease_id),
            no_write_tag(lease.request_id, lease.lease_id))

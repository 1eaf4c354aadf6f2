"""Quarantine: freed reservations whose pages a prefill node may still write.

NIXL writes are one-sided: a prefill node that is slow, stopped, or whose RemoteSend the
router gave up on, can write into a reservation's slots after the reservation was aborted
or its lease ran out, and on shared memory such a write cannot be revoked while the writer
lives. So a reservation freed before its KV arrived is held here, pages and all, until
there is proof that no write can land:
- its KV-ready notification (the writes have landed; counted in `late_writes_total`),
- the prefill node's no-write notice (it never began writing),
- a settled Abort naming the lease (`settle`: the router knows no RemoteSend of that
  reservation can still write; one naming no lease settles nothing here),
- the named writer's answer to FenceWrites, or its death (decode/fence.py), asked at once
  and then again with backoff.
No page comes back on the strength of a clock. A writer that gives no proof by the lease's
end plus `grace_s` (on this node's monotonic clock) is *fenced*: listed in
`fenced_writers()` (the router stops sending it work), its held pages counted in
`fenced_pages()`, until it answers or is gone. Only a reservation with no named writer
(a caller that named none) falls back to lease end + grace.
Notifications carry the lease id, so a late one can only release its own reservation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from pdserve.decode.fence import Proof
from pdserve.decode.inbox import Interrupted, NotificationInbox
from pdserve.decode.leases import Lease
from pdserve.proto.tags import no_write_tag, notification_tag

log = logging.getLogger("pdserve.decode")
ASK_TIMEOUT_S = 1.0
MAX_BACKOFF_S = 2.0


class Quarantine:
    def __init__(self, inbox: NotificationInbox, free: Callable[[str], Awaitable[None]],
                 grace_s: float,
                 ask: Callable[[Lease, float], Awaitable[Proof | None]] | None = None) -> None:
        self.inbox = inbox
        self.free = free  # frees the engine request of a reservation (by its engine key)
        self.grace_s = grace_s
        self.ask = ask    # decode/fence.py ask_writer, or None: nobody to ask
        self._held: dict[str, Lease] = {}  # engine key -> lease
        self._fenced: dict[str, Lease] = {}  # engine key -> lease past grace without proof
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

    def settle(self, request_id: str, lease_id: str) -> bool:
        """Release the quarantined reservation (`request_id`, `lease_id`) now."""
        held = [lease for lease in self._held.values() if lease.request_id == request_id
                and lease.lease_id == lease_id]
        for lease in held:
            self._settled.add(lease.engine_key)  # a watch that has not begun yet sees it
            self.inbox.interrupt(tags(lease), Interrupted.SETTLED)
        return bool(held)

    def fenced_writers(self) -> list[str]:
        return sorted({lease.writer_address for lease in self._fenced.values()})

    def fenced_pages(self) -> int:
        return sum(lease.num_pages for lease in self._fenced.values())

    async def _watch(self, lease: Lease) -> None:
        kv_tag = notification_tag(lease.request_id, lease.lease_id)
        until = lease.expires_at + self.grace_s
        try:
            if lease.engine_key in self._settled:
                why = Interrupted.SETTLED
            elif self.ask is None or not lease.writer_address:
                why = await self.inbox.wait(tags(lease), until - time.monotonic())
            else:
                why = await self._proof(lease, until)
            if why in (kv_tag, Proof.WROTE):
                self.late_writes_total += 1
                log.warning("late KV write for freed reservation %s landed in quarantine",
                            lease.engine_key)
            await self.free(lease.engine_key)
        finally:
            self._held.pop(lease.engine_key, None)
            self._fenced.pop(lease.engine_key, None)
            self._settled.discard(lease.engine_key)

    async def _proof(self, lease: Lease, until: float) -> object:
        """Wait for the writer's word or ask it, until one proves no write can land."""
        backoff = 0.05
        while True:
            why = await self.inbox.wait(tags(lease), backoff)
            if why is not None:
                return why
            if lease.engine_key in self._settled:  # settled while we were asking
                return Interrupted.SETTLED
            try:
                proof = await self.ask(lease, ASK_TIMEOUT_S)
            except Exception as err:  # a bug here must not drop the pages: ask again later
                log.warning("asking %s for proof about %s failed: %r", lease.writer_address,
                            lease.engine_key, err)
                proof = None
            if proof is not None:
                return proof
            if time.monotonic() >= until and lease.engine_key not in self._fenced:
                self._fenced[lease.engine_key] = lease
                log.warning("prefill node %s neither confirmed nor ended its write of %s by "
                            "the lease's end plus grace: fenced, %d pages held until it answers "
                            "or is gone", lease.writer_address, lease.engine_key, lease.num_pages)
            backoff = min(backoff * 2, MAX_BACKOFF_S)


def tags(lease: Lease) -> tuple[bytes, bytes]:
    return (notification_tag(lease.request_id, lease.lease_id),
            no_write_tag(lease.request_id, lease.lease_id))

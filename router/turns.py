"""Dispatch slots, handed out in turns that are fair between tenants.

At most `slots` requests hold a slot at once. Past that, each tenant's requests wait in the
tenant's own line, in order of their priority (lower first, as vLLM's), then first come
first served, and a freed slot goes to the next tenant in a round robin over the tenants
with a request waiting (a tenant of weight w takes w turns in a row). A tenant that starts
waiting joins the ring at its end. So however many requests one tenant queues, another's
first request waits for at most one turn of each tenant ahead of it in the ring, not for
the whole flood.

Invariants: a request waits only while every slot is taken: a freed slot is handed to the
next waiter in `release` itself, with no await between. A waiter that went away (timed out,
cancelled) takes no turn; a slot handed to one just as it went away is passed on, never lost.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Mapping


class TenantTurns:
    def __init__(self, slots: int, weights: Mapping[str, int] | None = None) -> None:
        self.slots = slots
        self.running = 0  # slots held
        self.weights = dict(weights or {})
        # Each tenant's waiters, a heap of (priority, arrival, waiter); the dict's order is
        # the ring, its first tenant's turn next.
        self._lines: dict[str, list[tuple[int, int, asyncio.Future]]] = {}
        self._arrivals = itertools.count()
        self._head: str | None = None  # the tenant whose turns `_streak` counts
        self._streak = 0

    def waiting(self, tenant: str | None = None) -> int:
        """Requests waiting for a turn: of `tenant`, or of all."""
        if tenant is not None:
            return len(self._lines.get(tenant, ()))
        return sum(len(line) for line in self._lines.values())

    async def acquire(self, tenant: str, timeout_s: float | None, priority: int = 0) -> None:
        """Take a slot, after waiting for `tenant`'s turn if all are held (ahead of the
        tenant's waiters of a higher `priority`); TimeoutError after `timeout_s` (None: no
        bound) without one."""
        if self.running < self.slots and not self._lines:
            self.running += 1
            return
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        heapq.heappush(self._lines.setdefault(tenant, []), (priority, next(self._arrivals), waiter))
        timer = None if timeout_s is None else loop.call_later(timeout_s, _expire, waiter)
        self._grant()  # (a slot may be free while only gone waiters were in line)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.release()  # handed a slot just as it went away: the next takes it
            else:
                self._drop(tenant, waiter)
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def release(self) -> None:
        self.running -= 1
        self._grant()

    def _grant(self) -> None:
        while self.running < self.slots and self._lines:
            tenant = next(iter(self._lines))
            line = self._lines[tenant]
            waiter = heapq.heappop(line)[2]
            if not line:
                del self._lines[tenant]
            if waiter.done():  # timed out or cancelled, not yet dropped: no turn
                continue
            waiter.set_result(None)
            self.running += 1
            if self._head != tenant:
                self._head, self._streak = tenant, 0
            self._streak += 1
            if tenant in self._lines and self._streak >= self.weights.get(tenant, 1):
                self._lines[tenant] = self._lines.pop(tenant)  # to the end of the ring
                self._head = None

    def _drop(self, tenant: str, waiter: asyncio.Future) -> None:
        line = self._lines.get(tenant)
        entry = next((e for e in line or () if e[2] is waiter), None)
        if entry is not None:
            line.remove(entry)
            heapq.heapify(line)
            if not line:
                del self._lines[tenant]


def parse_weights(text: str) -> dict[str, int]:
    """`--tenant-weights` TENANT=W,... as {tenant: W}; "" is {} (every tenant 1)."""
    weights: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        tenant, _, value = item.partition("=")
        try:
            weight = int(value)
        except ValueError:
            weight = 0
        if not tenant.strip() or weight < 1:
            raise ValueError(f"--tenant-weights: {item!r} is not TENANT=W with a whole W >= 1")
        weights[tenant.strip()] = weight
    return weights


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())

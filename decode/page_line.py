"""The line for KV pages: reservations that find too few free pages wait here, first come
first served, instead of being refused.

Invariants:
- Order: a reservation that finds others waiting joins behind them even if it would fit
  now, so a large request is never overtaken for ever by smaller ones of its priority; it
  goes ahead only of those of a higher priority number (the request's priority, lower
  first), never of the head. Only the head tries again, whenever pages may have come back
  (`freed()`, called wherever the decode node frees a request) and at least every
  `poll_s`. One exception: a reservation of a better priority than every waiting one
  tries once before it joins, as if none waited.
- An attempt also takes pages from running requests of a worse priority when theirs are
  enough (the engine preempts them, `prepare_receive`).
- Bounded: at most `max_waiting` wait (the next is RESOURCE_EXHAUSTED at once), and each
  waits no longer than `max_wait_s` or what its caller's deadline leaves (then
  RESOURCE_EXHAUSTED, before the caller gives up, so the caller hears why and when to come
  back). A waiter that leaves (served, timed out, aborted, cancelled) hands the head to
  the next.
- Nothing is held while waiting: an attempt either reserves all it needs or nothing
  (engine allocation is all or nothing).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

from pdserve.engine import OutOfPages
from pdserve.runtime.errors import NodeOverloaded

T = TypeVar("T")


class QueueFull(NodeOverloaded):
    """RESOURCE_EXHAUSTED with how long the caller should wait before it tries again."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class PageLine:
    def __init__(self, max_waiting: int, max_wait_s: float, poll_s: float = 0.05) -> None:
        self.max_waiting = max_waiting
        self.max_wait_s = max_wait_s
        self.poll_s = poll_s
        self._line: deque[asyncio.Future] = deque()  # each waiter's turn, head first
        self._priority: dict[asyncio.Future, int] = {}  # each turn's request's priority
        self._freed = asyncio.Event()
        self._joined = asyncio.Event()  # a waiter joined the line
        self.waited_total = 0  # reservations that waited (served or not)

    def __len__(self) -> int:
        return len(self._line)

    async def until_waiting(self, n: int) -> None:
        """Return once at least `n` reservations wait in line (for observers, e.g. tests)."""
        while len(self._line) < n:
            self._joined.clear()
            await self._joined.wait()

    def freed(self) -> None:
        """Pages may have come back: the head tries again now."""
        self._freed.set()

    async def wait(self, attempt: Callable[[], Awaitable[T]], bound_s: float | None, priority: int = 0
                   ) -> tuple[T, float]:
        """`attempt()`'s result (it raises OutOfPages while pages are short) and the
        seconds spent in line, which it joins behind every turn of its `priority` or lower.
        It tries at once when none waits, or when all that wait have a worse priority (its
        attempt may preempt running requests that they may not)."""
        if not self._line or priority < min(self._priority.values()):
            try:
                return await attempt(), 0.0
            except OutOfPages:
                pass
        if len(self._line) >= self.max_waiting:
            raise QueueFull(f"{len(self._line)} reservations already wait for KV pages (limit "
                            f"max_queued_reservations {self.max_waiting})", self.max_wait_s)
        started = time.monotonic()
        limit = self.max_wait_s if bound_s is None else min(self.max_wait_s, bound_s)
        deadline = started + max(0.0, limit)
        turn = asyncio.get_running_loop().create_future()
        place = len(self._line)
        while place > 1 and self._priority[self._line[place - 1]] > priority:
            place -= 1
        self._line.insert(place, turn)
        self._priority[turn] = priority
        self._joined.set()
        self.waited_total += 1
        if self._line[0] is turn:
            turn.set_result(None)
        try:
            try:
                await asyncio.wait_for(asyncio.shield(turn), deadline - time.monotonic())
            except asyncio.TimeoutError:
                raise self._timed_out(started, "behind earlier reservations") from None
            while True:
                self._freed.clear()
                try:
                    return await attempt(), time.monotonic() - started
                except OutOfPages as err:
                    short = str(err)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._timed_out(started, f"at the head of the line ({short})")
                try:
                    await asyncio.wait_for(self._freed.wait(), min(self.poll_s, left))
                except asyncio.TimeoutError:
                    pass
        finally:
            self._line.remove(turn)
            del self._priority[turn]
            if self._line and not self._line[0].done():
                self._line[0].set_result(None)

    def _timed_out(self, started: float, where: str) -> QueueFull:
        waited = time.monotonic() - started
        return QueueFull(f"waited {waited:.1f} s for KV pages {where}; the bound was "
                         f"max_queue_wait_s {self.max_wait_s} or the caller's deadline",
                         retry_after_s=max(1.0, waited))

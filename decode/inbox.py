"""Notifications from prefill nodes, matched to whoever waits for them.

A prefill node posts a tag per reservation (`proto.tags`): KV-ready after its writes
landed, or no-write when it gave up before writing. `NotificationInbox.wait(tags)` returns
the first of `tags` to arrive. Invariants:
- One pump task takes everything the agent received, in its own thread (NIXL calls may
  block briefly), every `poll_s` while someone waits; with no waiter there is no pump, so
  an idle node polls nothing.
- A tag nobody waits for yet is kept (a prefill node may finish before StartGeneration
  comes), up to `max_unclaimed` of them, oldest dropped first: memory stays bounded.
- `interrupt(tags, why)` ends a wait early with an `Interrupted` reason (an Abort, a
  settled release).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("pdserve.decode")


class Interrupted(enum.Enum):
    """Why a wait ended without a notification."""

    SETTLED = "settled"  # no write can come any more (a settled Abort)
    ABORTED = "aborted"  # the request was aborted; a write may still come


class NotificationInbox:
    def __init__(self, agent, poll_s: float = 0.002, max_unclaimed: int = 4096) -> None:
        self.agent = agent
        self.poll_s = poll_s
        self.max_unclaimed = max_unclaimed
        self._unclaimed: OrderedDict[bytes, None] = OrderedDict()
        self._waiters: dict[bytes, asyncio.Future] = {}
        self._pump: asyncio.Task | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-notify")

    async def wait(self, tags: tuple[bytes, ...], timeout_s: float) -> bytes | Interrupted | None:
        """The first of `tags` that arrived (consumed), the reason of an `interrupt`, or
        None after `timeout_s`."""
        for tag in tags:
            if tag in self._unclaimed:
                del self._unclaimed[tag]
                return tag
        future = asyncio.get_running_loop().create_future()
        for tag in tags:
            self._waiters[tag] = future
        if self._pump is None or self._pump.done():
            self._pump = asyncio.ensure_future(self._run_pump())
        try:
            return await asyncio.wait_for(asyncio.shield(future), max(0.0, timeout_s))
        except asyncio.TimeoutError:
            return None
        finally:
            for tag in tags:
                if self._waiters.get(tag) is future:
                    del self._waiters[tag]

    def interrupt(self, tags: tuple[bytes, ...], why: Interrupted) -> None:
        for tag in tags:
            future = self._waiters.get(tag)
            if future is not None and not future.done():
                future.set_result(why)

    async def _run_pump(self) -> None:
        loop = asyncio.get_running_loop()
        while self._waiters:
            try:
                notes = await loop.run_in_executor(self._thread, self.agent.take_notifications)
            except Exception as err:  # the agent is closing; waits end by their timeouts
                log.warning("taking NIXL notifications failed: %s", err)
                notes = []
            for _, tag in notes:
                future = self._waiters.get(tag)
                if future is not None and not future.done():
                    future.set_result(tag)
                else:
                    self._unclaimed[tag] = None
                    while len(self._unclaimed) > self.max_unclaimed:
                        self._unclaimed.popitem(last=False)
            await asyncio.sleep(self.poll_s)

    def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
        self._thread.shutdown(wait=False, cancel_futures=True)

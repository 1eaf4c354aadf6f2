"""The router's load monitor: slow polls while it serves nothing, the busy rate while a
request is on a node however long ago it came, and the first request after idling wakes it
to poll at once rather than after a whole idle interval."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from pdserve.router.load import LoadMonitor


class CountingMonitor(LoadMonitor):
    """Counts polls instead of calling nodes (what a poll asks is not the subject here)."""

    def __init__(self, **kwargs) -> None:
        self.node = SimpleNamespace(in_flight=0)
        super().__init__(registry=SimpleNamespace(endpoints=lambda: [self.node]), **kwargs)
        self.polls = 0
        self.polled = asyncio.Event()

    async def poll_once(self) -> None:
        self.polls += 1
        self.polled.set()


def test_a_request_wakes_an_idle_monitor_at_once():
    async def main():
        # An idle interval no test would wait for: only the wake can bring the second poll.
        monitor = CountingMonitor(interval_s=0.01, idle_interval_s=3600.0, idle_after_s=0.0)
        task = asyncio.ensure_future(monitor.run())
        try:
            await monitor.polled.wait()  # the first poll; the monitor is idle from here
            assert monitor.polls == 1
            monitor.polled.clear()
            monitor.mark_busy()
            await monitor.polled.wait()
            assert monitor.polls == 2
        finally:
            task.cancel()

    asyncio.run(main())


def test_a_request_still_on_a_node_keeps_it_polling_at_the_busy_rate():
    async def main():
        monitor = CountingMonitor(interval_s=0.001, idle_interval_s=3600.0, idle_after_s=0.0)
        monitor.node.in_flight = 1  # a long stream: started long ago, not finished
        task = asyncio.ensure_future(monitor.run())
        try:
            while monitor.polls < 3:
                monitor.polled.clear()
                await monitor.polled.wait()
        finally:
            task.cancel()

    asyncio.run(main())

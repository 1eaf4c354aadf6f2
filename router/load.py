"""Load reports: the router polls every node's `GetLoad` in the background.

Each report gives a node's queue (prefill: RemoteSends in progress; decode: requests
generating plus reservations parked) and its free and total KV pages; it lands on the
`Endpoint` together with how many of this router's own requests were on the node when it
was asked, so `Endpoint.queue` counts the router's own requests once and adds only what
other routers sent.

Cheap when idle: while the router serves nothing and has had no request for `idle_after_s`,
it polls every `idle_interval_s` instead of every `interval_s`, and the first request after
that wakes it to poll at once (what it routes by is then one poll old, not one idle
interval). A node that does not implement GetLoad is not asked again; one that does not
answer keeps its last report (health checks decide whether it is used). A prefill node a
decode node reports as fenced (decode/quarantine.py) is handed to the health check, as if a
call to it had failed.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from pdserve.proto import pdserve_pb2
from pdserve.router.registry import Endpoint, WorkerRegistry

log = logging.getLogger("pdserve.router")

IDLE_AFTER_S = 2.0  # no request for this long: the router is idle


class LoadMonitor:
    def __init__(self, registry: WorkerRegistry, interval_s: float = 0.1,
                 idle_interval_s: float = 5.0, idle_after_s: float = IDLE_AFTER_S,
                 timeout_s: float = 1.0) -> None:
        self.registry = registry
        self.interval_s = interval_s
        self.idle_interval_s = idle_interval_s
        self.idle_after_s = idle_after_s
        self.timeout_s = timeout_s
        self.last_request = 0.0  # monotonic; the dispatcher marks each request
        self._unsupported: set[str] = set()
        self._woken = asyncio.Event()

    @property
    def idle(self) -> bool:
        return (time.monotonic() - self.last_request > self.idle_after_s
                and not any(e.in_flight for e in self.registry.endpoints()))

    def mark_busy(self) -> None:
        self.last_request = time.monotonic()
        self._woken.set()  # ends an idle wait; each poll clears it first, so it never lingers

    async def poll_once(self) -> None:
        endpoints = [e for e in self.registry.endpoints()
                     if e.routable and e.address not in self._unsupported]
        await asyncio.gather(*(self._poll(e) for e in endpoints))

    async def _poll(self, endpoint: Endpoint) -> None:
        mine = endpoint.in_flight
        try:
            report = await endpoint.monitor_stub.GetLoad(pdserve_pb2.LoadRequest(),
                                                 timeout=self.timeout_s)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._unsupported.add(endpoint.address)
            return
        endpoint.reported_queue = report.num_running + report.num_parked
        endpoint.in_flight_at_report = mine
        endpoint.free_pages, endpoint.total_pages = report.free_pages, report.total_pages
        endpoint.steps = report  # its step fields: router/selective.py weighs them
        self.registry.check_lease(endpoint, report.max_lease_ms)
        if report.total_pages:
            endpoint.prefixes.capacity = report.total_pages  # at most what the node can cache
        for address in report.fenced_writers:  # D holds pages it has no proof for: no more
            for writer in self.registry.prefill:  # work for that writer until it is healthy
                if writer.address == address and writer.routable:
                    self.registry.report_failure(writer, f"fenced by decode node "
                                                         f"{endpoint.address}")

    async def run(self) -> None:
        while True:
            self._woken.clear()  # what woke it is served by this poll; a request during it is kept
            try:
                await self.poll_once()
            except Exception as err:  # never let a bad report stop the monitor
                log.warning("load poll failed: %s", err)
            if not self.idle:
                await asyncio.sleep(self.interval_s)
                continue
            try:
                await asyncio.wait_for(self._woken.wait(), self.idle_interval_s)
            except asyncio.TimeoutError:
                pass

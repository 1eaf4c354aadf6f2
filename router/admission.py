"""Admission: which requests the router takes, and when each gets its turn.

Bounded: at most `max_concurrent_requests` dispatch at once and `max_queued_requests` wait
for a turn (first come, first served); past both, RESOURCE_EXHAUSTED, never unbounded
growth. A request waits for its turn no longer than its own deadline (DEADLINE_EXCEEDED)
or `max_queue_wait_s` (RESOURCE_EXHAUSTED). A draining router
(SIGTERM) takes nothing new; request ids are unique among the requests it holds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc

from pdserve.router.config import RouterConfig
from pdserve.router.state import DispatchError, RequestState
from pdserve.runtime import metrics


class Admission:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.active: dict[str, RequestState] = {}
        self.draining = False
        self._running = 0  # requests holding a dispatch slot
        self._slots = asyncio.Semaphore(config.max_concurrent_requests)

    def admit(self, request_id: str, timeout_s: float | None) -> RequestState:
        """The state of a request the router takes now; raises DispatchError otherwise."""
        if self.draining:
            raise DispatchError(grpc.StatusCode.UNAVAILABLE,
                                "router is draining (shutting down): no new requests")
        if request_id in self.active:
            raise DispatchError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"duplicate request_id {request_id!r}")
        c = self.config
        queued = len(self.active) - self._running
        if self._running >= c.max_concurrent_requests and queued >= c.max_queued_requests:
            raise DispatchError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"router is full: {self._running} requests running and "
                                f"{queued} waiting (limits {c.max_concurrent_requests} and "
                                f"{c.max_queued_requests})")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        state = self.active[request_id] = RequestState(request_id, deadline=deadline)
        return state

    @asynccontextmanager
    async def turn(self, state: RequestState) -> AsyncIterator[None]:
        """Hold a dispatch slot for the body; wait for one first (first come, first
        served), up to the deadline and `max_queue_wait_s`."""
        bound = self.config.max_queue_wait_s
        left = None if state.deadline is None else max(0.0, state.deadline - time.monotonic())
        started = time.monotonic()
        try:
            await asyncio.wait_for(self._slots.acquire(), bound if left is None else min(left, bound))
        except asyncio.TimeoutError:
            if left is not None and left <= bound:
                raise DispatchError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"request {state.request_id} ran out of its deadline while "
                                    "queued at the router") from None
            raise DispatchError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"request {state.request_id} waited {bound:g} s for a turn at the "
                                "router (max_queue_wait_s)") from None
        state.queue_s += time.monotonic() - started
        metrics.QUEUE_TIME.labels(role="router").observe(time.monotonic() - started)
        self._running += 1
        try:
            yield
        finally:
            self._running -= 1
            self._slots.release()

    def leave(self, state: RequestState) -> None:
        del self.active[state.request_id]

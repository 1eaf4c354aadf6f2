"""Admission: which requests the router takes, and when each gets its turn.

Bounded: at most `max_concurrent_requests` dispatch at once and `max_queued_requests` wait
for a turn; past both, RESOURCE_EXHAUSTED, never unbounded growth. Turns are fair between
tenants (router/turns.py: a round robin over the tenants' own FIFO lines), and a tenant may
be bounded alone: `max_queued_requests_per_tenant` waiting, `tenant_token_rate` tokens per
second (router/token_rate.py). A request waits for its turn no longer than its own deadline
(DEADLINE_EXCEEDED) or `max_queue_wait_s` (RESOURCE_EXHAUSTED). A draining router (SIGTERM)
takes nothing new. Request ids are unique per tenant among the requests the router holds:
`active` is keyed by (tenant, the client's id), so another tenant's id neither collides
nor shows.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc

from pdserve.router.config import RouterConfig
from pdserve.router.state import DispatchError, RequestState, node_request_id
from pdserve.router.token_rate import TokenRate
from pdserve.router.turns import TenantTurns, parse_weights
from pdserve.runtime import metrics
from pdserve.runtime.checks import sampling_from_pb


def admission_tokens(prompt_token_ids, sampling) -> int:
    """What a request costs its tenant's token rate: the prompt and all it may generate
    (`sampling`: a pdserve_pb2.SamplingParams)."""
    params = sampling_from_pb(sampling)
    return len(prompt_token_ids) + params.max_tokens * params.n


class Admission:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.active: dict[tuple[str, str], RequestState] = {}  # (tenant, client's id)
        self.draining = False
        self.turns = TenantTurns(config.max_concurrent_requests,
                                 parse_weights(config.tenant_weights))
        self.token_rate = TokenRate(config.tenant_token_rate) if config.tenant_token_rate \
            else None

    def admit(self, request_id: str, timeout_s: float | None, tenant: str = "default",
              tokens: int = 0) -> RequestState:
        """The state of a request of `tenant` the router takes now, `tokens` its cost for
        the token rate; raises DispatchError otherwise."""
        if self.draining:
            raise DispatchError(grpc.StatusCode.UNAVAILABLE,
                                "router is draining (shutting down): no new requests")
        if (tenant, request_id) in self.active:
            raise DispatchError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"duplicate request_id {request_id!r}")
        try:
            node_id = node_request_id(tenant, request_id)
        except ValueError as err:
            raise DispatchError(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None
        c, running = self.config, self.turns.running
        if running >= c.max_concurrent_requests:  # it would wait for a turn
            queued = len(self.active) - running
            if queued >= c.max_queued_requests:
                raise DispatchError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"router is full: {running} requests running and {queued} "
                                    f"waiting (limits {c.max_concurrent_requests} and "
                                    f"{c.max_queued_requests})")
            limit, own = c.max_queued_requests_per_tenant, self.turns.waiting(tenant)
            if limit and own >= limit:
                raise DispatchError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"tenant {tenant!r} has {own} requests waiting for a turn "
                                    f"(limit {limit}, --max-queued-requests-per-tenant)")
        self._spend(tenant, tokens)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        state = RequestState(node_id, tenant=tenant, client_id=request_id, deadline=deadline)
        self.active[(tenant, request_id)] = state
        return state

    def _spend(self, tenant: str, tokens: int) -> None:
        wait_s = None if self.token_rate is None else self.token_rate.take(tenant, tokens)
        if wait_s is not None:
            error = DispatchError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  f"tenant {tenant!r} is past its token rate "
                                  f"({self.config.tenant_token_rate:g} tokens/s, "
                                  f"--tenant-token-rate): this request's {tokens} tokens "
                                  f"fit in {wait_s:.1f} s; retry then")
            error.retry_after_s = max(1, math.ceil(wait_s))
            raise error

    def find(self, tenant: str, request_id: str) -> RequestState | None:
        """`tenant`'s request `request_id`, if the router holds it (another's: None)."""
        return self.active.get((tenant, request_id))

    @asynccontextmanager
    async def turn(self, state: RequestState) -> AsyncIterator[None]:
        """Hold a dispatch slot for the body; wait for the tenant's turn first, up to the
        deadline and `max_queue_wait_s`."""
        bound = self.config.max_queue_wait_s
        left = None if state.deadline is None else max(0.0, state.deadline - time.monotonic())
        started = time.monotonic()
        try:
            await self.turns.acquire(state.tenant, bound if left is None else min(left, bound),
                                     state.priority)
        except TimeoutError:
            if left is not None and left <= bound:
                raise DispatchError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"request {state.client_id} ran out of its deadline while "
                                    "queued at the router") from None
            raise DispatchError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"request {state.client_id} waited {bound:g} s for a turn at the "
                                "router (max_queue_wait_s)") from None
        state.queue_s += time.monotonic() - started
        metrics.QUEUE_TIME.labels(role="router").observe(time.monotonic() - started)
        try:
            yield
        finally:
            self.turns.release()

    def leave(self, state: RequestState) -> None:
        del self.active[(state.tenant, state.client_id)]

"""Worker registry: the prefill and decode endpoints the router may use.

Endpoints come from static lists or DNS names (`router.discovery`, which replaces a role's
pool through `set_addresses`); health-driven exclusion updates `Endpoint.routable`, so
policies only ever see routable endpoints.
One gRPC channel per endpoint is opened once and shared by every request.

Health: when a call fails in a way that may mean the node is gone, `report_failure` checks
the node's gRPC health service at once; while the check fails the endpoint is not
routable, and it is checked again every `health_interval_s` until it passes (then its
channel is reopened, so no reconnect backoff of the dead connection delays it). A node
that is draining answers NOT_SERVING and is left alone the same way.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.server import channel
from proto import pdserve_pb2_grpc
from router.policies import Policy

log = logging.getLogger("pdserve.router")


@dataclass(eq=False)
class Endpoint:
    """One Worker node as seen by the router."""

    address: str
    role: str  # "prefill" | "decode"
    routable: bool = True
    in_flight: int = 0
    _channel: grpc.aio.Channel | None = field(default=None, repr=False)
    _watch: asyncio.Task | None = field(default=None, repr=False)  # health checks while down

    @property
    def stub(self) -> pdserve_pb2_grpc.WorkerStub:
        if self._channel is None:
            self._channel = channel(self.address)
        return pdserve_pb2_grpc.WorkerStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


class NoEndpointError(RuntimeError):
    """No routable endpoint of the requested role."""


class WorkerRegistry:
    def __init__(
        self,
        prefill: Sequence[str],
        decode: Sequence[str],
        prefill_policy: Policy,
        decode_policy: Policy,
        health_interval_s: float = 1.0,
        health_timeout_s: float = 2.0,
    ) -> None:
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.prefill = [Endpoint(a, "prefill") for a in prefill]
        self.decode = [Endpoint(a, "decode") for a in decode]
        self._policies = {"prefill": prefill_policy, "decode": decode_policy}
        self._retired: list[Endpoint] = []

    async def set_addresses(self, role: str, addresses: Sequence[str]) -> None:
        """Make `role`'s pool exactly `addresses` (discovery). Endpoints that stay keep their
        state; a removed one is closed once no request still uses it."""
        current = {e.address: e for e in getattr(self, role)}
        setattr(self, role, [current.pop(a, None) or Endpoint(a, role) for a in addresses])
        self._retired += current.values()
        idle = [e for e in self._retired if e.in_flight == 0]
        self._retired = [e for e in self._retired if e.in_flight > 0]
        for endpoint in idle:
            await endpoint.close()

    def pick(self, role: str, prompt_token_ids: Sequence[int], exclude=()) -> Endpoint:
        pool = [e for e in (self.prefill if role == "prefill" else self.decode)
                if e.routable and e not in exclude]
        if not pool:
            raise NoEndpointError(f"no routable {role} endpoint"
                                  + (" left to try" if exclude else ""))
        return self._policies[role].pick(pool, prompt_token_ids)

    def report_failure(self, endpoint: Endpoint, reason: str) -> None:
        """A call to `endpoint` failed as if the node were gone: check its health now."""
        if endpoint._watch is None or endpoint._watch.done():
            endpoint._watch = asyncio.ensure_future(self._watch_health(endpoint, reason))

    async def _watch_health(self, endpoint: Endpoint, reason: str) -> None:
        while endpoint in self.prefill or endpoint in self.decode:
            if await self._serving(endpoint):
                if not endpoint.routable:
                    log.warning("%s node %s passes its health check again", endpoint.role,
                                endpoint.address)
                    await endpoint.close()  # a fresh channel, without the dead one's backoff
                    endpoint.routable = True
                return
            if endpoint.routable:
                log.warning("%s node %s is down (%s); not routing to it until its health "
                            "check passes", endpoint.role, endpoint.address, reason)
                endpoint.routable = False
            await asyncio.sleep(self.health_interval_s)

    async def _serving(self, endpoint: Endpoint) -> bool:
        try:
            async with channel(endpoint.address) as ch:  # its own: no shared backoff state
                reply = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=self.health_timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def has_prefill(self) -> bool:
        return any(e.routable for e in self.prefill)

    async def close(self) -> None:
        for endpoint in [*self.prefill, *self.decode, *self._retired]:
            if endpoint._watch is not None:
                endpoint._watch.cancel()
            await endpoint.close()

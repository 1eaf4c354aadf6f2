"""Worker registry: the prefill and decode endpoints the router may use.

Endpoints come from static lists for now; discovery (etcd) and health-driven exclusion
update the same `Endpoint.routable` flag, so policies only ever see routable endpoints.
One gRPC channel per endpoint is opened once and shared by every request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import grpc

from pdserve.server import channel
from proto import pdserve_pb2_grpc
from router.policies import Policy


@dataclass(eq=False)
class Endpoint:
    """One Worker node as seen by the router."""

    address: str
    role: str  # "prefill" | "decode"
    routable: bool = True
    in_flight: int = 0
    _channel: grpc.aio.Channel | None = field(default=None, repr=False)

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
    ) -> None:
        self.prefill = [Endpoint(a, "prefill") for a in prefill]
        self.decode = [Endpoint(a, "decode") for a in decode]
        self._policies = {"prefill": prefill_policy, "decode": decode_policy}

    def pick(self, role: str, prompt_token_ids: Sequence[int]) -> Endpoint:
        pool = [e for e in (self.prefill if role == "prefill" else self.decode) if e.routable]
        if not pool:
            raise NoEndpointError(f"no routable {role} endpoint")
        return self._policies[role].pick(pool, prompt_token_ids)

    def has_prefill(self) -> bool:
        return any(e.routable for e in self.prefill)

    async def close(self) -> None:
        for endpoint in [*self.prefill, *self.decode]:
            await endpoint.close()

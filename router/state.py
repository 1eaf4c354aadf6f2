"""What the router knows of one request in flight, and why one fails.

Invariant: every node that may hold state for the request (D from PrepareReceive on, P
while its RemoteSend is in flight) is in `holders` before the call is made, so an abort,
an error or a client disconnect reaches all of them (router/calls.py `release`).
`kv_write_pending` is True while a RemoteSend may still write D's reservation: an Abort
then tells D not to reuse the pages at once.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from pdserve.proto import pdserve_pb2
from pdserve.runtime.errors import NodeError


class DispatchError(NodeError):
    """A failure with the gRPC status and message the client should see. `detail`: for the
    router's log, naming the call and the node (never sent to the client). `settled`:
    (RemoteSend only) the prefill node answered without writing anything."""

    def __init__(self, code: grpc.StatusCode, message: str, settled: bool = False,
                 detail: str = "") -> None:
        super().__init__(message, code)
        self.settled = settled
        self.detail = detail or message


@dataclass
class RequestState:
    request_id: str
    arrived: float = field(default_factory=time.perf_counter)
    deadline: float | None = None  # the client's, on the monotonic clock
    holders: set = field(default_factory=set)  # router.registry.Endpoint that may hold it
    # Decode nodes that may hold a reservation of it with no lease known here (a PrepareReceive
    # failed after it may have reserved): the request reserves on them no more.
    maybe_reserved: set = field(default_factory=set)
    kv_write_pending: bool = False  # a RemoteSend may still write D's reservation
    route: pdserve_pb2.RouteInfo = field(default_factory=pdserve_pb2.RouteInfo)
    prompt_tokens: int = 0
    ttft: float = 0.0
    queue_s: float = 0.0  # waited for a turn: a dispatch slot here, KV pages on D
    prefill_s: float = 0.0   # the prefill node's prefill and KV writes (RemoteSend's reply)
    transfer_s: float = 0.0
    aborted: bool = False
    local: bool = False  # D prefills the whole prompt itself (selective disaggregation)

    def timeout(self, bound_s: float | None) -> float | None:
        """`bound_s` (None: none) cut to what is left of the client's deadline."""
        if self.deadline is None:
            return bound_s
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DispatchError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"request {self.request_id} ran out of its deadline")
        return left if bound_s is None else min(bound_s, left)

    def check_aborted(self) -> None:
        if self.aborted:
            raise DispatchError(grpc.StatusCode.CANCELLED, f"request {self.request_id} aborted")


@dataclass
class Reserved:
    """D's reservation, with when its lease ends (monotonic)."""

    prep: pdserve_pb2.PrepareReceiveResponse
    lease_ends: float


@dataclass
class EarlySend:
    """A RemoteSend sent before D reserved (`window_follows`), waiting for its window."""

    prefill: object  # router.registry.Endpoint
    call: asyncio.Future
    token: object = None  # from `prefill.send_started()`: its time counts for saturation

"""What the router knows of one request in flight, and why one fails.

Invariant: every node that may hold state for the request (D from PrepareReceive on, P
while its RemoteSend is in flight) is in `holders` before the call is made, so an abort,
an error or a client disconnect reaches all of them (router/calls.py `release`).
`kv_write_pending` is True while a RemoteSend may still write D's reservation: an Abort
then tells D not to reuse the pages at once. A request belongs to a tenant (the caller's API
key, runtime/tenants.py): `request_id` is the id the nodes know it by (`node_request_id`),
`client_id` the client's own, the only one the client ever sees.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from pdserve.proto import pdserve_pb2
from pdserve.runtime.checks import MAX_REQUEST_ID_CHARS
from pdserve.runtime.errors import NodeError
from pdserve.runtime.tenants import DEFAULT


class DispatchError(NodeError):
    """A failure with the gRPC status and message the client should see. `detail`: for the
    router's log, naming the call and the node (never sent to the client). `settled`:
    (RemoteSend only) the prefill node answered without writing anything."""

    def __init__(self, code: grpc.StatusCode, message: str, settled: bool = False,
                 detail: str = "") -> None:
        super().__init__(message, code)
        self.settled = settled
        self.detail = detail or message


def node_request_id(tenant: str, request_id: str) -> str:
    """The id the nodes know a request by: the client's own for the tenant `default` (as
    before tenants), `id@tenant` otherwise, so equal ids of two tenants never meet on a
    node. A `default` id holding '@' gets '@default' too: tenant names hold no '@', so no
    tenant's id can spell another's. Raises ValueError past the nodes' length limit."""
    if tenant == DEFAULT and "@" not in request_id:
        return request_id
    node_id = f"{request_id}@{tenant}"
    if len(node_id) > MAX_REQUEST_ID_CHARS:
        raise ValueError(f"request_id of {len(request_id)} characters is too long for tenant "
                         f"{tenant!r}: at most {MAX_REQUEST_ID_CHARS - len(tenant) - 1}")
    return node_id


@dataclass
class RequestState:
    request_id: str  # what the nodes know it by: `node_request_id(tenant, client_id)`
    tenant: str = DEFAULT
    client_id: str = ""  # the client's own id ("": request_id)
    cache_salt: str = ""  # the nodes' prefix-cache salt for it (router/cache_salt.py)
    cache_key: str = ""  # its prompt_cache_key: the nodes it goes to (router/policies.py)
    priority: int = 0  # lower waits less, here and on the nodes (GenerateRequest.priority)
    lora: str = ""  # the LoRA adapter it runs with on the nodes (GenerateRequest.model); "": none
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

    def __post_init__(self) -> None:
        self.client_id = self.client_id or self.request_id

    @property
    def placement(self) -> dict:
        """What a policy weighs besides the prompt (the registry's `pick`)."""
        return {"cache_salt": self.cache_salt, "cache_key": self.cache_key}

    def timeout(self, bound_s: float | None) -> float | None:
        """`bound_s` (None: none) cut to what is left of the client's deadline."""
        if self.deadline is None:
            return bound_s
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DispatchError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"request {self.client_id} ran out of its deadline")
        return left if bound_s is None else min(bound_s, left)

    def record_route(self, prep: pdserve_pb2.PrepareReceiveResponse, sent: bool,
                     reason: str) -> None:
        """D's reservation `prep` into the route; `sent`: a RemoteSend wrote its window."""
        route = self.route
        route.prefix_matched_length = route.kv_window_begin = prep.prefix_matched_length
        route.kv_window_end = prep.kv_window_end
        route.remote_send_skipped = not sent
        if not sent:
            route.prefill_endpoint = ""
            route.prefill_cached_tokens = 0
            route.skip_reason = route.skip_reason or reason or "requested"

    def check_aborted(self) -> None:
        if self.aborted:
            raise DispatchError(grpc.StatusCode.CANCELLED, f"request {self.client_id} aborted")


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

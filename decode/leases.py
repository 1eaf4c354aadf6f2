"""Reservation leases: a parked reservation lives until StartGeneration, Abort or expiry.

Invariants: every reservation in the table has exactly one pending expiry timer; `take`
and `drop` remove the entry and cancel its timer, so a reservation is released exactly
once, by whichever comes first. Lease ids are random, so a call carrying a stale lease id
(of an expired or replaced reservation with the same request id) is refused.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from pdserve.runtime.errors import NodeError


class LeaseError(NodeError):
    """No live reservation matches: NOT_FOUND for an unknown request id (`missing`),
    FAILED_PRECONDITION for a wrong lease id."""

    def __init__(self, message: str, missing: bool) -> None:
        super().__init__(message, grpc.StatusCode.NOT_FOUND if missing
                         else grpc.StatusCode.FAILED_PRECONDITION)
        self.missing = missing


@dataclass
class Lease:
    request_id: str
    lease_id: str
    prompt_len: int
    prefix_matched_length: int
    kv_window_end: int
    expires_at: float
    engine_key: str = ""  # the engine's id of this reservation (unique per lease)
    reserve_s: float = 0.0  # how long the reservation took (for the request's log line)
    queued_s: float = 0.0   # of which it waited in line for KV pages (decode/page_line.py)
    # Local prefill (selective disaggregation): nothing reserved; at StartGeneration the
    # prompt enters the engine as an ordinary request with these ids and params.
    local_prompt: list[int] | None = None
    local_params: object = None
    local_cache_salt: str = ""
    local_priority: int = 0
    local_lora: str = ""
    writer_address: str = ""  # the prefill node that may write it (asked for proof on free)
    num_pages: int = 0        # pages its window reserved
    caller: str = ""          # who reserved it (runtime/auth.py caller_of)
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


def engine_key_for(request_id: str, lease_id: str) -> str:
    """The engine's id of a reservation: unique per lease, so a request id that comes back
    with a new reservation never meets the pages of its old one, perhaps still quarantined."""
    return f"{request_id}@{lease_id[:12]}"


class LeaseTable:
    def __init__(self, on_expire: Callable[[Lease], Awaitable[None]]) -> None:
        self._leases: dict[str, Lease] = {}
        self._on_expire = on_expire
        self._expiring: set[asyncio.Task] = set()
        self.expired_total = 0

    def __len__(self) -> int:
        return len(self._leases)

    def parked_pages(self, caller: str) -> int:
        """Pages held by `caller`'s reservations that wait for StartGeneration."""
        return sum(lease.num_pages for lease in self._leases.values() if lease.caller == caller)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._leases

    def grant(self, request_id: str, duration_s: float, lease_id: str | None = None,
              **info) -> Lease:
        lease = Lease(request_id, lease_id or uuid.uuid4().hex,
                      expires_at=time.monotonic() + duration_s, **info)
        lease.timer = asyncio.get_running_loop().call_later(duration_s, self.expire, lease)
        self._leases[request_id] = lease
        return lease

    def take(self, request_id: str, lease_id: str) -> Lease:
        return self.drop(self.peek(request_id, lease_id).request_id)

    def peek(self, request_id: str, lease_id: str) -> Lease:
        """The live lease of `request_id` if `lease_id` matches; raises LeaseError."""
        lease = self._leases.get(request_id)
        if lease is None:
            raise LeaseError(f"no reservation for request {request_id!r} "
                             "(never made, already started, aborted or expired)", missing=True)
        if lease.lease_id != lease_id:
            raise LeaseError(f"lease {lease_id!r} does not match the reservation of request "
                             f"{request_id!r}", missing=False)
        return lease

    def drop(self, request_id: str, lease_id: str = "") -> Lease | None:
        """Remove the request's lease (with `lease_id`: only if it is that one)."""
        if lease_id and getattr(self._leases.get(request_id), "lease_id", lease_id) != lease_id:
            return None
        lease = self._leases.pop(request_id, None)
        if lease is not None and lease.timer is not None:
            lease.timer.cancel()
        return lease

    def expire(self, lease: Lease) -> None:
        """The lease ran out (its timer calls this): hand it to `on_expire`, once."""
        if self._leases.get(lease.request_id) is not lease:
            return
        del self._leases[lease.request_id]
        lease.timer.cancel()  # when called before its time
        self.expired_total += 1
        task = asyncio.ensure_future(self._on_expire(lease))
        self._expiring.add(task)
        task.add_done_callback(self._expiring.discard)

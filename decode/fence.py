"""Asking the prefill node named as a reservation's writer for proof that no write of it
can still land (FenceWrites), before the decode node reuses the reservation's pages.

`ask_writer(lease, timeout_s)` answers:
- `Proof.CONFIRMED`: the process listening at the writer's address answered: it ended
  every write of the lease and will start none. (Whoever answers proves it: the writer
  itself, or a process that took its port, which the writer, still holding it, could
  not have let happen: servers bind without SO_REUSEPORT.)
- `Proof.GONE`: nothing listens there any more (connection refused): the writer's process
  is dead, and a dead process writes nothing.
- None: no answer within `timeout_s` (stopped, partitioned, overloaded): nothing proven.
"""

from __future__ import annotations

import enum

import grpc

from pdserve.decode.leases import Lease
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.runtime.server import channel


class Proof(enum.Enum):
    CONFIRMED = "confirmed"  # no write can land any more
    WROTE = "wrote"          # ... because the write in progress landed
    GONE = "gone"


async def ask_writer(lease: Lease, timeout_s: float) -> Proof | None:
    try:
        async with channel(lease.writer_address, own_connections=True) as ch:
            reply = await pdserve_pb2_grpc.WorkerStub(ch).FenceWrites(
                pdserve_pb2.FenceRequest(request_id=lease.request_id, lease_id=lease.lease_id),
                timeout=timeout_s, wait_for_ready=False)
    except grpc.aio.AioRpcError as err:
        if err.code() == grpc.StatusCode.UNAVAILABLE and "refused" in (err.details() or "").lower():
            return Proof.GONE
        return None
    return Proof.WROTE if reply.wrote else Proof.CONFIRMED

"""gRPC edge of the decode role: PrepareReceive and StartGeneration.

Converts messages to engine objects, calls one DecodeRole method, maps errors to statuses:
bad input -> INVALID_ARGUMENT, no room -> RESOURCE_EXHAUSTED, draining -> UNAVAILABLE,
unknown or expired reservation -> NOT_FOUND, wrong lease -> FAILED_PRECONDITION, KV not
arrived -> DEADLINE_EXCEEDED, prefill node gave up writing -> FAILED_PRECONDITION, aborted
-> CANCELLED. A StartGeneration cancelled by its caller aborts the request.
"""

from __future__ import annotations

import contextlib
import time

import grpc

from decode.convert import sampling_from_pb, stream_responses
from decode.leases import LeaseError
from decode.role import DecodeRole, KVNotArrived, KVNotWritten
from engine import OutOfPages
from pdserve.errors import NodeDraining, NodeOverloaded, RequestAborted
from proto import pdserve_pb2
from proto.checks import check_request_id, check_sampling

STATUS_OF = [  # most specific first: KVNotWritten etc. are not ValueErrors, LeaseError neither
    (NodeDraining, grpc.StatusCode.UNAVAILABLE),
    (NodeOverloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (OutOfPages, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (RequestAborted, grpc.StatusCode.CANCELLED),
    (KVNotArrived, grpc.StatusCode.DEADLINE_EXCEEDED),
    (KVNotWritten, grpc.StatusCode.FAILED_PRECONDITION),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
]


def status_of(err: Exception) -> grpc.StatusCode | None:
    if isinstance(err, LeaseError):
        return grpc.StatusCode.NOT_FOUND if err.missing else grpc.StatusCode.FAILED_PRECONDITION
    return next((code for cls, code in STATUS_OF if isinstance(err, cls)), None)


class DecodeEdge:
    def __init__(self, role: DecodeRole, vocab_size: int, max_model_len: int) -> None:
        self.role = role
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    async def _prepare(self, request, context):
        """Check one PrepareReceiveRequest and reserve for it (or abort the call)."""
        try:
            check_request_id(request.request_id)
            check_sampling(request.sampling, self.vocab_size, self.max_model_len)
            params = sampling_from_pb(request.sampling)
            params.validate(vocab_size=self.vocab_size, max_model_len=self.max_model_len)
            return await self.role.prepare_receive(
                request.request_id, list(request.prompt_token_ids), params,
                request.kv_window_end, request.lease_ms, request.local_prefill)
        except Exception as err:
            code = status_of(err)
            if code is None:
                raise
            await context.abort(code, str(err))

    async def prepare_receive(self, request, context):
        prepared = await self._prepare(request, context)
        lease = prepared.lease
        remaining = lease.expires_at - time.monotonic()
        return pdserve_pb2.PrepareReceiveResponse(
            request_id=request.request_id, prefix_matched_length=lease.prefix_matched_length,
            kv_window_end=lease.kv_window_end, kv_append_metadata=prepared.kv_append_metadata,
            lease_id=lease.lease_id, lease_ms=round(remaining * 1000),
            decode_agent_name=self.role.agent.name,
            lease_expires_unix_ms=round((time.time() + remaining) * 1000))

    async def start_generation(self, request, context):
        arrived = time.perf_counter()
        lease_id, begin, expect_kv = (request.lease_id, request.kv_window_begin,
                                      request.expect_kv_notification)
        if request.HasField("prepare"):  # local prefill in one call
            prepare = request.prepare
            if prepare.request_id != request.request_id or not prepare.local_prefill:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    "an inline prepare must be a local_prefill PrepareReceive "
                                    f"of request {request.request_id!r}")
            prepared = await self._prepare(prepare, context)
            lease_id, begin, expect_kv = prepared.lease.lease_id, 0, False
        outputs = self.role.start_generation(request.request_id, lease_id, begin, expect_kv,
                                             context.time_remaining())
        try:
            async for msg in stream_responses(request.request_id, outputs, arrived):
                yield msg
        except Exception as err:
            code = status_of(err)
            if code is None:
                raise
            await context.abort(code, str(err))
        finally:
            with contextlib.suppress(Exception):
                await outputs.aclose()

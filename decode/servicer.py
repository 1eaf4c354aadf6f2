"""gRPC edge of the decode role: PrepareReceive and StartGeneration.

Converts messages to engine objects, calls one DecodeRole method, maps errors to statuses:
bad input -> INVALID_ARGUMENT, no room -> RESOURCE_EXHAUSTED, unknown or expired
reservation -> NOT_FOUND, wrong lease -> FAILED_PRECONDITION, KV not arrived ->
DEADLINE_EXCEEDED. A StartGeneration cancelled by its caller aborts the request.
"""

from __future__ import annotations

import contextlib
import time

import grpc

from decode.convert import sampling_from_pb, stream_responses
from decode.leases import LeaseError
from decode.role import DecodeRole, KVNotArrived
from proto import pdserve_pb2


def _out_of_pages(err: Exception) -> bool:
    return type(err).__name__ == "OutOfPages"


class DecodeEdge:
    def __init__(self, role: DecodeRole, vocab_size: int, max_model_len: int) -> None:
        self.role = role
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    async def prepare_receive(self, request, context):
        params = sampling_from_pb(request.sampling)
        try:
            params.validate(vocab_size=self.vocab_size, max_model_len=self.max_model_len)
            prepared = await self.role.prepare_receive(
                request.request_id, list(request.prompt_token_ids), params,
                request.kv_window_end, request.lease_ms)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except Exception as err:
            if _out_of_pages(err):
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
            raise
        lease = prepared.lease
        return pdserve_pb2.PrepareReceiveResponse(
            request_id=request.request_id, prefix_matched_length=lease.prefix_matched_length,
            kv_window_end=lease.kv_window_end, kv_append_metadata=prepared.kv_append_metadata,
            lease_id=lease.lease_id, lease_ms=round((lease.expires_at - time.monotonic()) * 1000),
            decode_agent_name=self.role.agent.name)

    async def start_generation(self, request, context):
        arrived = time.perf_counter()
        outputs = self.role.start_generation(request.request_id, request.lease_id,
                                             request.kv_window_begin, request.expect_kv_notification)
        try:
            async for msg in stream_responses(request.request_id, outputs, arrived):
                yield msg
        except LeaseError as err:
            code = grpc.StatusCode.NOT_FOUND if err.missing else grpc.StatusCode.FAILED_PRECONDITION
            await context.abort(code, str(err))
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except KVNotArrived as err:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(err))
        finally:
            with contextlib.suppress(Exception):
                await outputs.aclose()

"""The decode role's half of the Worker service: PrepareReceive and StartGeneration
(worker/service.py assembles a node's Worker service from the halves of its roles).

Each RPC converts its message to one of the role's request objects, calls that one method,
converts the answer back, and records what it observed; failures become statuses through
`runtime.errors` (bad input INVALID_ARGUMENT, no room RESOURCE_EXHAUSTED, draining
UNAVAILABLE, unknown or expired reservation NOT_FOUND, wrong lease or a prefill node that
gave up writing FAILED_PRECONDITION, KV not arrived DEADLINE_EXCEEDED, aborted CANCELLED).
A StartGeneration cancelled by its caller aborts the request.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict

from pdserve.decode.convert import stream_responses
from pdserve.decode.role import DecodeRole, LocalPrefill, PrepareReceive, StartGeneration
from pdserve.proto import pdserve_pb2
from pdserve.runtime import metrics
from pdserve.runtime.checks import check_request_id, sampling_from_pb
from pdserve.runtime.auth import caller_of
from pdserve.runtime.errors import abort_with
from pdserve.runtime.observe import StreamObserver, outcome_of, record_failure

# PrepareReceive facts wait here for the request's StartGeneration log line; bounded,
# because a reservation may never be started (lease expiry, abort).
_MAX_REMEMBERED = 10_000


def local_from_pb(pb: pdserve_pb2.PrepareReceiveRequest) -> LocalPrefill:
    if pb.kv_window_end != 0:
        raise ValueError(f"local_prefill needs kv_window_end 0, got {pb.kv_window_end}")
    return LocalPrefill(pb.request_id, list(pb.prompt_token_ids), sampling_from_pb(pb.sampling),
                        pb.lease_ms, pb.cache_salt, pb.priority, pb.lora)


def prepare_from_pb(pb: pdserve_pb2.PrepareReceiveRequest, caller: str = "",
                    timeout_s: float | None = None) -> PrepareReceive:
    return PrepareReceive(pb.request_id, list(pb.prompt_token_ids), sampling_from_pb(pb.sampling),
                          pb.kv_window_end, pb.lease_ms, pb.writer_address, caller, timeout_s,
                          pb.cache_salt, pb.priority, pb.lora)


class DecodeService:
    def __init__(self, role: DecodeRole) -> None:
        self.role = role
        self._reserved: OrderedDict[str, dict] = OrderedDict()

    async def PrepareReceive(self, request, context):
        try:
            check_request_id(request.request_id)
            if request.local_prefill:
                prepared = await self.role.prepare_local(local_from_pb(request))
            else:
                prepared = await self.role.prepare_receive(
                    prepare_from_pb(request, caller_of(context), context.time_remaining()))
        except BaseException as err:
            record_failure("decode", request.request_id, err, phase="PrepareReceive")
            await abort_with(context, err)
        lease = prepared.lease
        metrics.record_prefix_lookup("decode", len(request.prompt_token_ids),
                                     lease.prefix_matched_length)
        self._remember(request.request_id, prepare_receive_s=lease.reserve_s,
                       prefix_matched=lease.prefix_matched_length,
                       kv_window_end=lease.kv_window_end)
        lease_ms = prepared.lease_ms or round((lease.expires_at - time.monotonic()) * 1000)
        return pdserve_pb2.PrepareReceiveResponse(
            request_id=request.request_id, prefix_matched_length=lease.prefix_matched_length,
            kv_window_end=lease.kv_window_end, kv_append_metadata=prepared.kv_append_metadata,
            lease_id=lease.lease_id, lease_ms=lease_ms, decode_agent_name=self.role.agent.name,
            lease_expires_unix_ms=round(time.time() * 1000) + lease_ms,
            capability=prepared.capability, issued_unix_ms=prepared.issued_unix_ms,
            queued_ms=round(lease.queued_s * 1000))

    async def StartGeneration(self, request, context):
        arrived = time.perf_counter()
        observer = StreamObserver("decode", request.request_id,
                                  **self._reserved.pop(request.request_id, {}),
                                  kv_expected=request.expect_kv_notification)
        outputs = None
        try:
            if request.HasField("prepare"):  # local prefill in one call
                prepare = request.prepare
                if prepare.request_id != request.request_id or not prepare.local_prefill:
                    raise ValueError("an inline prepare must be a local_prefill PrepareReceive "
                                     f"of request {request.request_id!r}")
                check_request_id(prepare.request_id)
                outputs = self.role.generate_local(local_from_pb(prepare), context.time_remaining())
            else:
                outputs = self.role.start_generation(StartGeneration(
                    request.request_id, request.lease_id, request.kv_window_begin,
                    request.expect_kv_notification, context.time_remaining()))
            async for msg in observer.watch(stream_responses(request.request_id, outputs,
                                                             arrived)):
                yield msg
        except Exception as err:
            observer.finish(outcome_of(err), error=str(err))  # no-op once watch recorded it
            await abort_with(context, err)
        finally:
            if outputs is not None:
                with contextlib.suppress(Exception):
                    await outputs.aclose()

    def _remember(self, request_id: str, **facts) -> None:
        self._reserved[request_id] = facts
        while len(self._reserved) > _MAX_REMEMBERED:
            self._reserved.popitem(last=False)

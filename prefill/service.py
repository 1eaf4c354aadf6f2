"""The prefill role's half of the Worker service: RemoteSend, DeliverWindow and FenceWrites
(worker/service.py assembles a node's Worker service from the halves of its roles).

Each RPC converts its message to one of the role's request objects, calls that one method
and converts the answer back; RemoteSend also records the transfer (metrics and the
request's log line). Failures become statuses through `runtime.errors`: bad ids, windows or
metadata INVALID_ARGUMENT (checked before the decode peer is contacted); a decode peer that
cannot take this node's KV, or a lease that ended, FAILED_PRECONDITION; an unreachable
peer or a failed write UNAVAILABLE; too many RemoteSends RESOURCE_EXHAUSTED; draining
UNAVAILABLE; aborted CANCELLED; deadline passed before writing DEADLINE_EXCEEDED; a
window whose capability does not check, or that was used or fenced already,
PERMISSION_DENIED. FenceWrites answers once no write of the named lease can land. A
RemoteSend cancelled by its caller aborts the prefill (pages are released either way).
"""

from __future__ import annotations

import time

from pdserve.prefill.peers import PeerInfo, PeerRef
from pdserve.prefill.requests import OverlappedSend, RemoteSend, Window
from pdserve.prefill.role import PrefillRole
from pdserve.proto import pdserve_pb2
from pdserve.runtime import metrics
from pdserve.runtime.checks import check_request_id
from pdserve.runtime.errors import abort_with
from pdserve.runtime.logs import log_request
from pdserve.runtime.observe import record_failure

WINDOW_FIELDS = ("lease_id", "decode_agent_name", "decode_address")


def window_from_pb(pb, info: PeerInfo | None = None) -> Window:
    """The decode node's half of a RemoteSend (a RemoteSendRequest or RemoteSendWindow),
    its lease deadline counted from now on this node's monotonic clock."""
    for name in WINDOW_FIELDS:
        if not getattr(pb, name):
            raise ValueError(f"{name} must be set, got {getattr(pb, name)!r}")
    left_ms = pb.lease_remaining_ms if not pb.lease_ms else min(pb.lease_remaining_ms, pb.lease_ms)
    return Window(pb.kv_window_begin, list(pb.kv_append_metadata), pb.lease_id,
                  PeerRef(pb.decode_agent_name, pb.decode_address, info),
                  time.monotonic() + left_ms / 1000, pb.lease_ms, pb.capability,
                  pb.issued_unix_ms)


class PrefillService:
    def __init__(self, role: PrefillRole) -> None:
        self.role = role

    async def RemoteSend(self, request, context):
        started = time.perf_counter()
        try:
            check_request_id(request.request_id)
            prompt = list(request.prompt_token_ids)
            if request.window_follows:
                result = await self.role.remote_send_overlapped(OverlappedSend(
                    request.request_id, prompt, request.kv_window_end, context.time_remaining(),
                    request.cache_salt, request.priority, request.lora))
            else:
                info = PeerInfo.from_pb(request.decode_transfer_info) \
                    if request.HasField("decode_transfer_info") else None
                result = await self.role.remote_send(RemoteSend(
                    request.request_id, prompt, request.kv_window_end,
                    window_from_pb(request, info), context.time_remaining(), request.cache_salt,
                    request.priority, request.lora))
        except BaseException as err:
            outcome = record_failure("prefill", request.request_id, err,
                                     remote_send_s=time.perf_counter() - started)
            metrics.KV_TRANSFERS.labels(outcome=outcome).inc()
            await abort_with(context, err)
        metrics.record_transfer(result.num_bytes, result.num_descriptors, result.num_tokens_sent,
                                result.prefill_s, result.transfer_s)
        metrics.record_prefix_lookup("prefill", result.kv_window_end, result.prefill_cached_tokens)
        metrics.REQUESTS.labels(role="prefill", outcome="ok").inc()
        log_request("prefill", request.request_id, "ok",
                    kv_window=f"{result.kv_window_begin}:{result.kv_window_end}",
                    prefill_cached_tokens=result.prefill_cached_tokens, prefill_s=result.prefill_s,
                    transfer_s=result.transfer_s, remote_send_s=time.perf_counter() - started,
                    kv_bytes=result.num_bytes, kv_descriptors=result.num_descriptors,
                    kv_writes=result.num_writes)
        return pdserve_pb2.RemoteSendResponse(
            request_id=request.request_id, num_tokens_sent=result.num_tokens_sent,
            num_bytes=result.num_bytes, num_descriptors=result.num_descriptors,
            prefill_cached_tokens=result.prefill_cached_tokens, prefill_s=result.prefill_s,
            transfer_s=result.transfer_s)

    async def DeliverWindow(self, request, context):
        """The decode node's half of an overlapped RemoteSend."""
        try:
            check_request_id(request.request_id)
            try:
                window = window_from_pb(request)
            except ValueError as err:  # the waiting RemoteSend fails with the same reason
                window = err
            found = await self.role.deliver_window(request.request_id, window)
        except Exception as err:
            await abort_with(context, err)
        return pdserve_pb2.DeliverWindowResponse(found=found)

    async def FenceWrites(self, request, context):
        """A decode node's ask for proof that no write of a freed reservation can land."""
        try:
            check_request_id(request.request_id)
            was_sending, wrote = await self.role.fence(request.request_id, request.lease_id)
        except Exception as err:
            await abort_with(context, err)
        return pdserve_pb2.FenceResponse(agent_name=self.role.agent.name,
                                         was_sending=was_sending, wrote=wrote)

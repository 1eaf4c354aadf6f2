"""gRPC edge of the prefill role: RemoteSend.

Bad ids, windows or metadata -> INVALID_ARGUMENT (checked before the decode peer is
contacted); a decode peer whose layout cannot take this node's KV -> FAILED_PRECONDITION;
an unreachable peer or a failed write -> UNAVAILABLE; too many RemoteSends at once ->
RESOURCE_EXHAUSTED; draining -> UNAVAILABLE; aborted -> CANCELLED; deadline passed before
writing -> DEADLINE_EXCEEDED. A RemoteSend cancelled by its caller aborts the prefill
(pages are released either way). A RemoteSend with `window_follows` is checked for its
prompt and window end only; the rest is checked when DeliverWindow brings it (a peer that
cannot take this node's KV then fails the RemoteSend with FAILED_PRECONDITION).
"""

from __future__ import annotations

import grpc

from kvtransfer.window import resolve_kv_window
from pdserve.errors import NodeDraining, NodeOverloaded, RequestAborted
from prefill.peers import DecodePeers, IncompatiblePeer
from prefill.role import DeadlinePassed, LeaseEnded, PrefillRole, Window
from proto import pdserve_pb2
from proto.checks import check_request_id

STATUS_OF = [
    (IncompatiblePeer, grpc.StatusCode.FAILED_PRECONDITION),
    (NodeDraining, grpc.StatusCode.UNAVAILABLE),
    (NodeOverloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (RequestAborted, grpc.StatusCode.CANCELLED),
    (LeaseEnded, grpc.StatusCode.FAILED_PRECONDITION),
    (DeadlinePassed, grpc.StatusCode.DEADLINE_EXCEEDED),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
]


def check_request(request) -> None:
    """What can be checked without the decode peer; raises ValueError naming the value."""
    check_request_id(request.request_id)
    if request.window_follows:
        resolve_kv_window(0, request.kv_window_end, len(request.prompt_token_ids))
        return
    for name in ("lease_id", "decode_agent_name", "decode_address", "lease_expires_unix_ms"):
        if not getattr(request, name):
            raise ValueError(f"{name} must be set, got {getattr(request, name)!r}")
    resolve_kv_window(request.kv_window_begin, request.kv_window_end,
                      len(request.prompt_token_ids))


class PrefillEdge:
    def __init__(self, role: PrefillRole, peers: DecodePeers) -> None:
        self.role = role
        self.peers = peers

    async def remote_send(self, request, context):
        info = request.decode_transfer_info if request.HasField("decode_transfer_info") else None
        try:
            check_request(request)
            peer = None if request.window_follows else \
                await self.peers.get(request.decode_agent_name, request.decode_address, info)
            result = await self.role.remote_send(
                request.request_id, list(request.prompt_token_ids), request.kv_window_begin,
                request.kv_window_end, list(request.kv_append_metadata), request.lease_id, peer,
                request.lease_expires_unix_ms / 1000, context.time_remaining(),
                window_follows=request.window_follows)
        except grpc.aio.AioRpcError as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"GetTransferInfo on {request.decode_address}: {err.details()}")
        except Exception as err:
            if type(err).__name__ == "TransferError":
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV write failed: {err}")
            code = next((c for cls, c in STATUS_OF if isinstance(err, cls)), None)
            if code is None:
                raise
            await context.abort(code, str(err))
        return pdserve_pb2.RemoteSendResponse(
            request_id=request.request_id, num_tokens_sent=result.num_tokens_sent,
            num_bytes=result.num_bytes, num_descriptors=result.num_descriptors,
            prefill_cached_tokens=result.prefill_cached_tokens, prefill_s=result.prefill_s,
            transfer_s=result.transfer_s)

    async def deliver_window(self, request, context):
        """The decode node's half of a `window_follows` RemoteSend."""
        try:
            check_request_id(request.request_id)
            for name in ("lease_id", "decode_agent_name", "decode_address", "lease_expires_unix_ms"):
                if not getattr(request, name):
                    raise ValueError(f"{name} must be set, got {getattr(request, name)!r}")
            peer = await self.peers.get(request.decode_agent_name, request.decode_address, None)
            window = Window(request.kv_window_begin, list(request.kv_append_metadata),
                            request.lease_id, peer, request.lease_expires_unix_ms / 1000)
        except (ValueError, IncompatiblePeer, grpc.aio.AioRpcError) as err:
            # The waiting RemoteSend fails with the same reason, without writing.
            reason = err if not isinstance(err, grpc.aio.AioRpcError) else IncompatiblePeer(
                f"GetTransferInfo on {request.decode_address}: {err.details()}")
            self.role.deliver_window(request.request_id, reason)
            code = grpc.StatusCode.INVALID_ARGUMENT if isinstance(err, ValueError) \
                else grpc.StatusCode.FAILED_PRECONDITION
            await context.abort(code, str(reason))
        found = self.role.deliver_window(request.request_id, window)
        return pdserve_pb2.DeliverWindowResponse(found=found)

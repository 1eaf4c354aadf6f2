"""gRPC edge of the prefill role: RemoteSend.

Bad windows or metadata -> INVALID_ARGUMENT; a decode peer whose layout cannot take this
node's KV -> FAILED_PRECONDITION; an unreachable peer or a failed write -> UNAVAILABLE.
A RemoteSend cancelled by its caller aborts the prefill (pages are released either way).
"""

from __future__ import annotations

import grpc

from prefill.peers import DecodePeers, IncompatiblePeer
from prefill.role import PrefillRole
from proto import pdserve_pb2


class PrefillEdge:
    def __init__(self, role: PrefillRole, peers: DecodePeers) -> None:
        self.role = role
        self.peers = peers

    async def remote_send(self, request, context):
        info = request.decode_transfer_info if request.HasField("decode_transfer_info") else None
        try:
            peer = await self.peers.get(request.decode_agent_name, request.decode_address, info)
            result = await self.role.remote_send(
                request.request_id, list(request.prompt_token_ids), request.kv_window_begin,
                request.kv_window_end, list(request.kv_append_metadata), request.lease_id, peer)
        except IncompatiblePeer as err:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        except grpc.aio.AioRpcError as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"GetTransferInfo on {request.decode_address}: {err.details()}")
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except Exception as err:
            if type(err).__name__ == "TransferError":
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV write failed: {err}")
            raise
        return pdserve_pb2.RemoteSendResponse(
            request_id=request.request_id, num_tokens_sent=result.num_tokens_sent,
            num_bytes=result.num_bytes, num_descriptors=result.num_descriptors,
            prefill_cached_tokens=result.prefill_cached_tokens, prefill_s=result.prefill_s,
            transfer_s=result.transfer_s)

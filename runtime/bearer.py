"""Bearer tokens in gRPC metadata: reading the one a call carries, and attaching one to
every call a channel makes.

A token travels as `authorization: Bearer <token>` (RFC 6750), the same header the OpenAI
HTTP API reads. Outgoing, `presenting()` gives grpc.aio client interceptors rather than call
credentials because gRPC refuses call credentials on plaintext channels, and the cluster
key must work with TLS off. Invariant: a call that already carries `authorization` (a
client sending its API key) keeps it; the interceptor never adds a second one.
"""

from __future__ import annotations

import grpc

HEADER = "authorization"
SCHEME = "bearer"


def bearer_of(metadata) -> str | None:
    """The token of the call's `authorization: Bearer` metadata, or None if it has none."""
    for key, value in metadata or ():
        if key == HEADER:
            value = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = value.partition(" ")
            return token.strip() if scheme.lower() == SCHEME else None
    return None


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata presenting `token`."""
    return ((HEADER, f"Bearer {token}"),)


class _Presenting:
    def __init__(self, token: str) -> None:
        self.token = token

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        if HEADER not in metadata:
            metadata.add(HEADER, f"Bearer {self.token}")
        return details._replace(metadata=metadata)


class _UnaryUnary(_Presenting, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _UnaryStream(_Presenting, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _StreamUnary(_Presenting, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _StreamStream(_Presenting, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


def presenting(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors that present `token` on every call of a channel, one per call
    kind (a channel files each interceptor under the first kind it implements only)."""
    return [kind(token) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]

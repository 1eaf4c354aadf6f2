"""An unauthenticated call is refused before its message is read (runtime/auth.py
`_refusing`): bytes no message parses as get UNAUTHENTICATED, where the same bytes with the
right credentials get a parse error, so the refusal comes first; unary and streaming RPCs,
Generation and Worker alike. Memory under 60 MB calls: tests/cluster/test_transport.py."""

from __future__ import annotations

import grpc

from pdserve.runtime import auth, cluster_key
from pdserve.runtime.bearer import bearer_metadata
from pdserve.runtime.cluster_key import ClusterKey
from tests.runtime.test_auth import API_KEY, KEY, Node, process_settings, run  # noqa: F401

GARBAGE = b"\x0a\xff\xff\xff\xff\xff\xff"  # a field tag, then a length no message has
CALLS = {"/pdserve.v1.Generation/Generate": "unary_stream",
         "/pdserve.v1.Generation/GetModelInfo": "unary_unary",
         "/pdserve.v1.Worker/PrepareReceive": "unary_unary",
         "/pdserve.v1.Worker/StartGeneration": "unary_stream"}


async def status_of(ch, method: str, metadata=None) -> grpc.StatusCode:
    call = getattr(ch, CALLS[method])(method, request_serializer=bytes,
                                      response_deserializer=bytes)(GARBAGE, metadata=metadata,
                                                                   timeout=10)
    try:
        if hasattr(call, "__aiter__"):
            [m async for m in call]
        else:
            await call
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def test_garbage_without_credentials_is_unauthenticated_and_with_them_a_parse_error():
    auth.configure("worker", API_KEY)
    cluster_key._key = KEY

    def credentials(method: str):
        generation = method.startswith("/pdserve.v1.Generation/")
        return bearer_metadata(API_KEY if generation else KEY.token("router"))

    async def main():
        async with Node() as address, grpc.aio.insecure_channel(address) as ch:
            for method in CALLS:
                assert await status_of(ch, method) == grpc.StatusCode.UNAUTHENTICATED, method
                assert await status_of(ch, method, bearer_metadata("sk-wrong")) == \
                    grpc.StatusCode.UNAUTHENTICATED, method
                parsed = await status_of(ch, method, credentials(method))
                assert parsed not in (grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED), \
                    (method, parsed)

    run(main())


def test_without_any_key_garbage_is_still_a_parse_error_not_a_refusal():
    cluster_key._key = ClusterKey(None)

    async def main():
        async with Node() as address, grpc.aio.insecure_channel(address) as ch:
            status = await status_of(ch, "/pdserve.v1.Generation/GetModelInfo")
            assert status not in (grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED)

    run(main())

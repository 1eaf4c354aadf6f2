"""OpenAI-shaped errors for failures the nodes report, over fake workers in-process (no
model): each gRPC status maps to its HTTP status, before the body for streams too, and a
failure after streaming began arrives as an error event before [DONE]."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import grpc
import pytest

from pdserve.proto import pdserve_pb2
from pdserve.router.openai_protocol import OpenAIError
from tests.router.fake_worker import FakeWorker, openai_router


class FailsMidStream(FakeWorker):
    async def StartGeneration(self, request, context):
        yield pdserve_pb2.GenerateResponse(request_id=request.request_id, text="<5>", token_ids=[5])
        await context.abort(grpc.StatusCode.INTERNAL, "decode node crashed")


async def _post(decode: list, body: dict) -> tuple[int, str]:
    """POST `body` to /v1/completions of an in-process router over `decode` workers."""
    async with openai_router(decode) as url, aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/completions", json={"model": "fake", **body}) as reply:
            return reply.status, await reply.text()


def post(decode: list, body: dict) -> tuple[int, str]:
    return asyncio.run(asyncio.wait_for(_post(decode, body), 30))


@pytest.mark.parametrize("code,status,kind", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    (grpc.StatusCode.NOT_FOUND, 404, "not_found_error"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
    (grpc.StatusCode.UNAVAILABLE, 503, "server_error"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "server_error"),
    (grpc.StatusCode.INTERNAL, 500, "server_error"),
])
def test_grpc_status_maps_to_http_status_and_error_type(code, status, kind):
    err = OpenAIError.from_status(code, "PrepareReceive on decode node x: top_k must be >= -1")
    assert err.status == status
    assert err.body() == {"error": {"message": err.message, "type": kind, "param": "top_k",
                                    "code": code.name.lower()}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_full_decode_node_is_a_429_even_when_streaming(stream):
    worker = FakeWorker("d", fail={"PrepareReceive": grpc.StatusCode.RESOURCE_EXHAUSTED})
    status, text = post([worker], {"prompt": "hello", "stream": stream})
    assert status == 429
    assert json.loads(text)["error"]["code"] == "resource_exhausted"


def test_an_unreachable_decode_node_is_a_503():
    status, text = post(["127.0.0.1:1"], {"prompt": "hello"})
    assert status == 503
    assert json.loads(text)["error"]["code"] == "unavailable"


def test_a_failure_after_streaming_began_is_an_error_event_before_done():
    status, text = post([FailsMidStream("d")], {"prompt": "hello", "stream": True})
    assert status == 200
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["text"] == "<5>"
    assert json.loads(events[-2])["error"]["code"] == "internal"
    assert events[-1] == "[DONE]"

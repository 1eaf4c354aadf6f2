"""vLLM-as-1P1D's proxy (`--compare-peer vllm-pd`) against a fake prefill/decode server
pair in this process: the test is about the proxy's protocol (vLLM's NixlConnector
disaggregation), not about vLLM, so no vLLM runs here."""

import asyncio
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from pdserve.benchmarks.serve.backends import OpenAIBackend
from pdserve.benchmarks.serve.pd_proxy import decode_request, make_app, prefill_request
from pdserve.benchmarks.serve.workload import BenchRequest

PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [3, 4],
          "remote_engine_id": "engine-p", "remote_host": "127.0.0.1", "remote_port": 5600}


class FakePair:
    """A prefill server answering JSON with `kv_transfer_params` (or an error), and a
    decode server streaming `max_tokens` SSE tokens; both keep what they were sent."""

    def __init__(self, prefill_status: int = 200, params: dict | None = PARAMS) -> None:
        self.prefill_status, self.params = prefill_status, params
        self.seen: dict[str, list[tuple[dict, str]]] = {"prefill": [], "decode": []}

    def prefill_app(self) -> web.Application:
        async def complete(request):
            self.seen["prefill"].append((await request.json(), request.headers["X-Request-Id"]))
            if self.prefill_status != 200:
                return web.json_response({"error": {"message": "too long"}},
                                         status=self.prefill_status)
            answer = {"choices": [{"text": " a", "finish_reason": "length"}]}
            if self.params is not None:
                answer["kv_transfer_params"] = self.params
            return web.json_response(answer)

        app = web.Application()
        app.router.add_post("/v1/completions", complete)
        return app

    def decode_app(self) -> web.Application:
        async def complete(request):
            body = await request.json()
            self.seen["decode"].append((body, request.headers["X-Request-Id"]))
            out = web.StreamResponse()
            out.content_type = "text/event-stream"
            await out.prepare(request)
            for i in range(body["max_tokens"]):
                event = {"choices": [{"index": 0, "text": f" t{i}"}]}
                await out.write(f"data: {json.dumps(event)}\n\n".encode())
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
            await out.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            await out.write(b"data: [DONE]\n\n")
            return out

        async def models(request):
            return web.json_response({"data": [{"id": "peer"}]})

        app = web.Application()
        app.router.add_post("/v1/completions", complete)
        app.router.add_get("/v1/models", models)
        return app


def run_through_proxy(pair: FakePair, requests: list[BenchRequest]):
    async def go():
        async with TestServer(pair.prefill_app()) as p, TestServer(pair.decode_app()) as d:
            prefill_url, decode_url = (str(s.make_url("")).rstrip("/") for s in (p, d))
            async with TestServer(make_app(prefill_url, decode_url)) as proxy:
                backend = OpenAIBackend(str(proxy.make_url("")).rstrip("/"), timeout_s=30)
                try:
                    model = (await backend.limits()).model
                    return model, [await backend.send(r) for r in requests]
                finally:
                    await backend.close()

    return asyncio.run(asyncio.wait_for(go(), 60))


def test_the_proxy_prefills_one_token_then_streams_from_decode_with_the_kv_params():
    pair = FakePair()
    model, (result,) = run_through_proxy(pair, [BenchRequest([5, 6, 7], 3, 4)])
    assert model == "peer"  # /v1/models is the decode server's
    assert result.ok, result.error
    assert (result.output_tokens, len(result.token_times)) == (4, 4)
    (prefill, prefill_id), = pair.seen["prefill"]
    (decode, decode_id), = pair.seen["decode"]
    assert prefill["prompt"] == decode["prompt"] == [5, 6, 7]
    assert prefill["max_tokens"] == 1 and prefill["stream"] is False
    assert "stream_options" not in prefill
    assert prefill["kv_transfer_params"]["do_remote_decode"] is True
    assert prefill["kv_transfer_params"]["do_remote_prefill"] is False
    # The decode server gets the client's request as sent, plus the prefill's KV params.
    assert decode["max_tokens"] == 4 and decode["stream"] is True
    assert decode["stream_options"] == {"include_usage": True}
    assert decode["kv_transfer_params"] == PARAMS
    assert prefill_id == decode_id


def test_a_prefill_error_reaches_the_client_and_nothing_is_decoded():
    pair = FakePair(prefill_status=400)
    _, (result,) = run_through_proxy(pair, [BenchRequest([5, 6], 2, 4)])
    assert not result.ok and "HTTP 400" in result.error and "too long" in result.error
    assert pair.seen["decode"] == []


def test_a_prefill_answer_without_kv_params_is_a_502_naming_the_connector():
    pair = FakePair(params=None)
    _, (result,) = run_through_proxy(pair, [BenchRequest([5, 6], 2, 4)])
    assert not result.ok and "HTTP 502" in result.error and "NixlConnector" in result.error
    assert pair.seen["decode"] == []


def test_prefill_and_decode_requests_leave_the_original_body_alone():
    body = {"prompt": [1], "max_tokens": 9, "min_tokens": 9, "stream": True,
            "stream_options": {"include_usage": True}}
    prefill = prefill_request(body)
    assert (prefill["max_tokens"], prefill["min_tokens"], prefill["stream"]) == (1, 1, False)
    assert body["max_tokens"] == 9 and "kv_transfer_params" not in body
    assert decode_request(body, {"kv_transfer_params": {"x": 1}})["kv_transfer_params"] == {"x": 1}
    with pytest.raises(ValueError, match="kv_transfer_params"):
        decode_request(body, {"choices": []})

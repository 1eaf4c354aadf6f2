"""The front of vLLM as 1P1D (`bench serve --compare-peer vllm-pd`): an OpenAI completions
endpoint that runs each request on vLLM's prefill server, then streams it from its decode
server, as vLLM's disaggregated-serving proxy does. Written here on aiohttp, not copied
from vLLM's examples; `python -m pdserve.benchmarks.serve.pd_proxy --prefill URL --decode
URL --port N` runs it as its own process.

`POST /v1/completions` (the protocol of vLLM's NixlConnector):
1. the request goes to the prefill server unchanged but for `max_tokens` 1 (and
   `max_completion_tokens`, `min_tokens` at most 1), no streaming, and
   `kv_transfer_params: {"do_remote_decode": true, "do_remote_prefill": false, ...}`,
   so the prefill server keeps the prompt's KV blocks for the decode server to read;
2. its JSON answer's `kv_transfer_params` (the blocks, engine id, host and port) go with
   the original request to the decode server, which reads the KV and generates;
3. the decode server's answer streams back byte for byte, status and type included.
A prefill failure is answered with the prefill server's status and body, so the client
sees it; both servers get the same `X-Request-Id`. `GET /v1/models` is the decode server's.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import uuid

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                  "remote_engine_id": None, "remote_block_ids": None,
                  "remote_host": None, "remote_port": None}


def prefill_request(body: dict) -> dict:
    """What the prefill server is asked: one token, no stream, KV kept for a remote decode."""
    out = copy.deepcopy(body)
    out["max_tokens"] = 1
    for key in ("max_completion_tokens", "min_tokens"):
        if key in out:
            out[key] = min(out[key], 1)
    out["stream"] = False
    out.pop("stream_options", None)
    out["kv_transfer_params"] = dict(PREFILL_PARAMS)
    return out


def decode_request(body: dict, prefill_answer: dict) -> dict:
    """The original request, with the prefill server's `kv_transfer_params`."""
    params = prefill_answer.get("kv_transfer_params")
    if not params:
        raise ValueError("the prefill server answered without kv_transfer_params; is it "
                         "running with --kv-transfer-config NixlConnector?")
    return {**body, "kv_transfer_params": params}


def make_app(prefill_url: str, decode_url: str):
    """The aiohttp application in front of the two servers (base URLs)."""
    import aiohttp
    from aiohttp import web

    http_key = web.AppKey("http", aiohttp.ClientSession)

    async def session_ctx(app):
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
        app[http_key] = aiohttp.ClientSession(timeout=timeout,
                                            connector=aiohttp.TCPConnector(limit=0))
        yield
        await app[http_key].close()

    async def models(request):
        async with request.app[http_key].get(f"{decode_url}/v1/models") as reply:
            return web.Response(status=reply.status, body=await reply.read(),
                                content_type=reply.content_type)

    async def completions(request):
        http = request.app[http_key]
        body = await request.json()
        headers = {"X-Request-Id": request.headers.get("X-Request-Id", str(uuid.uuid4()))}
        async with http.post(f"{prefill_url}/v1/completions", json=prefill_request(body),
                             headers=headers) as reply:
            answer = await reply.read()
            if reply.status != 200:
                return web.Response(status=reply.status, body=answer,
                                    content_type=reply.content_type)
        try:
            forward = decode_request(body, json_loads(answer))
        except ValueError as err:
            return web.json_response({"error": {"message": str(err)}}, status=502)
        async with http.post(f"{decode_url}/v1/completions", json=forward,
                             headers=headers) as reply:
            out = web.StreamResponse(status=reply.status)
            out.content_type = reply.content_type
            await out.prepare(request)
            async for chunk in reply.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    app = web.Application(client_max_size=64 << 20)
    app.cleanup_ctx.append(session_ctx)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    return app


def json_loads(raw: bytes) -> dict:
    import json

    try:
        return json.loads(raw)
    except ValueError as err:
        raise ValueError(f"the prefill server's answer is not JSON ({err}): {raw[:200]!r}") from None


async def serve(prefill_url: str, decode_url: str, host: str, port: int) -> None:
    from aiohttp import web

    runner = web.AppRunner(make_app(prefill_url, decode_url), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    print(f"pd_proxy listening on {host}:{port}", flush=True)
    await asyncio.Event().wait()  # until killed


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pdserve.benchmarks.serve.pd_proxy",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill", required=True, help="base URL of vLLM's prefill server")
    p.add_argument("--decode", required=True, help="base URL of vLLM's decode server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    import uvloop

    uvloop.run(serve(args.prefill.rstrip("/"), args.decode.rstrip("/"), args.host, args.port))


if __name__ == "__main__":
    main()

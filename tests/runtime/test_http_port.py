"""The HTTP port (runtime/http.py) on a real aiohttp server in this event loop, reached by
raw sockets: HTTPS whenever a TLS certificate is configured (plain HTTP refused unless
`--plain-http`), client certificates exactly when the gRPC port asks for them, a header
timeout that ends a slow-header client, a body timeout, a connection limit, and the API key
checked before a body is read."""

from __future__ import annotations

import asyncio
import ssl

import pytest

from pdserve.router.openai_http import OpenAIFrontend
from pdserve.runtime import auth, http, http_limits, tls
from pdserve.runtime.http import HTTPConfig, metrics_app, start_http
from tests.certs import CA
from tests.cluster.nodes import wait_for

GET = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
GENEROUS_S = 30.0  # bounds on time-outs the server enforces, far above them


@pytest.fixture(autouse=True)
def fresh_settings(monkeypatch):
    monkeypatch.setattr(tls, "_config", tls.TLSConfig())
    monkeypatch.setattr(http_limits, "_config", HTTPConfig())
    monkeypatch.setattr(auth, "_settings", auth.Settings())


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("http-certs")
    ca = CA()
    server, client = ca.issue("router.pdserve"), ca.issue("client.pdserve", hosts=False)
    for name, data in (("ca.pem", ca.cert), ("node.pem", server.cert), ("node-key.pem", server.key),
                       ("client.pem", client.cert), ("client-key.pem", client.key)):
        (d / name).write_bytes(data)
    return d


def client_context(certs, with_cert: bool = False) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    if with_cert:
        context.load_cert_chain(certs / "client.pem", certs / "client-key.pem")
    return context


async def serve(app=None):
    runner = await start_http(app or metrics_app(), "127.0.0.1", 0, "test")
    return runner, runner.addresses[0][1]


async def ask(port: int, request: bytes = GET, context: ssl.SSLContext | None = None) -> bytes:
    """The first bytes of the answer to `request`, b"" when the server closes without one."""
    try:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=context, server_hostname="localhost" if context else None)
        writer.write(request)
        answer = await asyncio.wait_for(reader.read(64), GENEROUS_S)
        writer.close()
        return answer
    except (ConnectionError, ssl.SSLError):
        return b""


async def closed_within(reader: asyncio.StreamReader, timeout_s: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), timeout_s) == b""
    except ConnectionError:
        return True
    except asyncio.TimeoutError:
        return False


def test_with_a_certificate_the_port_answers_https_only_unless_plain_http_is_asked(certs):
    tls.configure(tls.TLSConfig(cert=str(certs / "node.pem"), key=str(certs / "node-key.pem")))

    async def main():
        runner, port = await serve()
        try:
            assert (await ask(port, context=client_context(certs))).startswith(b"HTTP/1.1 200")
            assert not (await ask(port)).startswith(b"HTTP/")  # plain: no HTTP answer
        finally:
            await runner.cleanup()
        http.configure(HTTPConfig(plain_http=True))
        runner, port = await serve()
        try:
            assert (await ask(port)).startswith(b"HTTP/1.1 200")
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_the_http_port_asks_client_certificates_exactly_when_the_grpc_port_does(certs):
    tls.configure(tls.TLSConfig(cert=str(certs / "node.pem"), key=str(certs / "node-key.pem"),
                                ca=str(certs / "ca.pem"), require_client_cert=True))

    async def main():
        runner, port = await serve()
        try:
            assert not (await ask(port, context=client_context(certs))).startswith(b"HTTP/")
            answer = await ask(port, context=client_context(certs, with_cert=True))
            assert answer.startswith(b"HTTP/1.1 200")
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_a_client_sending_its_headers_a_byte_at_a_time_is_disconnected_after_the_timeout():
    http.configure(HTTPConfig(http_header_timeout_s=1.0))

    async def main():
        runner, port = await serve()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            loop = asyncio.get_running_loop()
            started, closed = loop.time(), False
            for byte in GET[:-2] * 100:  # never ends its headers
                try:
                    writer.write(bytes([byte]))
                    await writer.drain()
                except ConnectionError:
                    closed = True
                    break
                if await closed_within(reader, 0.1):
                    closed = True
                    break
                assert loop.time() - started < GENEROUS_S, "still open long past the timeout"
            assert closed
            assert (await ask(port)).startswith(b"HTTP/1.1 200")  # others still served
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_a_body_that_does_not_arrive_within_the_body_timeout_gets_408():
    http.configure(HTTPConfig(http_body_timeout_s=1.0))
    app = OpenAIFrontend(None, None, "m").app()

    async def main():
        runner, port = await serve(app)
        try:
            answer = await ask(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                     b"Content-Length: 100\r\n\r\n{")
            assert answer.startswith(b"HTTP/1.1 408")
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_connections_beyond_the_limit_are_closed_at_once():
    http.configure(HTTPConfig(http_max_connections=2))

    async def main():
        runner, port = await serve()
        try:
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            assert await closed_within(reader, GENEROUS_S)
            held[0][1].close()
            await held[0][1].wait_closed()
            async def one_fewer():  # the server notices the close on its next turn
                return len(runner.server.connections) < 2

            await wait_for(one_fewer, GENEROUS_S)
            assert (await ask(port)).startswith(b"HTTP/1.1 200")
            held[1][1].close()
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_without_the_api_key_a_post_is_refused_before_its_body_is_read():
    auth.configure(None, "sk-right")
    app = OpenAIFrontend(None, None, "m", api_keys=auth.current().api_keys).app()

    async def main():
        runner, port = await serve(app)
        try:  # announces 60 MB and sends 1 KB of it: the 401 does not wait for the rest
            answer = await ask(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                     b"Content-Length: 62914560\r\n\r\n" + b"x" * 1024)
            assert answer.startswith(b"HTTP/1.1 401")
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_browser_pages_of_allowed_origins_may_call_and_others_may_not():
    """CORS (runtime/cors.py), with the API key on: a preflight needs no key; an allowed
    origin's answers, refusals included, name it; another origin's preflight is a 403
    naming the flag; without --allowed-origins nothing is added."""
    import aiohttp

    auth.configure(None, "sk-right")
    ask_for = {"Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization, content-type"}

    async def main(origins: list[str]):
        http.configure(HTTPConfig(allowed_origins=origins))
        runner, port = await serve(OpenAIFrontend(None, None, "m", api_keys=auth.current().api_keys).app())
        try:
            async with aiohttp.ClientSession() as session:
                async def call(method, path, origin, **headers):
                    async with session.request(method, f"http://127.0.0.1:{port}{path}",
                                               headers={"Origin": origin, **headers}) as reply:
                        return reply.status, reply.headers, await reply.read()

                return [await call("OPTIONS", "/v1/chat/completions", "http://localhost:3000", **ask_for),
                        await call("GET", "/health", "http://localhost:3000"),
                        await call("GET", "/v1/models", "http://localhost:3000"),  # no key: 401
                        await call("OPTIONS", "/v1/chat/completions", "https://evil.example", **ask_for),
                        await call("GET", "/health", "https://evil.example")]
        finally:
            await runner.cleanup()

    pre, scrape, refused, evil, evil_get = asyncio.run(main(["https://app.example, http://localhost:3000"]))
    assert pre[0] == 204 and pre[1]["Access-Control-Allow-Origin"] == "http://localhost:3000"
    assert pre[1]["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert "POST" in pre[1]["Access-Control-Allow-Methods"]
    assert scrape[0] == 200 and scrape[1]["Access-Control-Allow-Origin"] == "http://localhost:3000"
    assert "X-Request-Id" in scrape[1]["Access-Control-Expose-Headers"] and scrape[1]["Vary"] == "Origin"
    assert refused[0] == 401 and refused[1]["Access-Control-Allow-Origin"] == "http://localhost:3000"
    assert evil[0] == 403 and b"--allowed-origins" in evil[2] and "Access-Control-Allow-Origin" not in evil[1]
    assert evil_get[0] == 200 and "Access-Control-Allow-Origin" not in evil_get[1]
    off = asyncio.run(main([]))
    assert off[0][0] == 401 and all("Access-Control-Allow-Origin" not in r[1] for r in off)
    with pytest.raises(ValueError, match="'app.example' is not an origin"):
        HTTPConfig(allowed_origins=["app.example"]).validate()


def test_a_streamed_answer_names_the_allowed_origin_too():
    import aiohttp

    from tests.router.fake_worker import FakeWorker, openai_router

    http.configure(HTTPConfig(allowed_origins=["*"]))

    async def main():
        async with openai_router([FakeWorker("d")]) as url, aiohttp.ClientSession() as session:
            async with session.post(f"{url}/v1/completions", headers={"Origin": "https://app.example"},
                                    json={"model": "fake", "prompt": "hi", "stream": True}) as reply:
                return reply.status, reply.headers, await reply.text()

    status, headers, body = asyncio.run(main())
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    assert headers["Access-Control-Allow-Origin"] == "https://app.example" and body.endswith("data: [DONE]\n\n")

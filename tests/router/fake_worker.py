"""In-process fakes for router tests: a Worker node that records calls and streams canned
tokens, a tokenizer of one id per character, and a router over such workers."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.kvtransfer.window import resolve_kv_window_end
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch import Dispatcher
from pdserve.router.policies import RoundRobin
from pdserve.router.registry import WorkerRegistry
from pdserve.router.service import GenerationService
from pdserve.router.tokenizer import ModelCard
from pdserve.router.tool_dialects import HERMES


class FakeWorker(pdserve_pb2_grpc.WorkerServicer):
    def __init__(self, name: str, matched: int = 0, tokens=(5, 6, 7), token_delay_s=0.0,
                 fail: dict | None = None, texts: list[str] | None = None, finish: str = "length"):
        """`texts`: each token's text (default "<id>"); `finish`: the last one's finish reason."""
        self.name = name
        self.matched = matched
        self.tokens = tokens if texts is None else tuple(range(10, 10 + len(texts)))
        self.texts = texts
        self.finish = finish
        self.token_delay_s = token_delay_s
        self.fail = fail or {}  # rpc name -> StatusCode
        self.calls: list[tuple[str, object]] = []
        self.aborted: list[str] = []
        self.remote_send_gate: asyncio.Event | None = None
        self.stream_gate: asyncio.Event | None = None  # StartGeneration streams once it is set
        self.windows: dict[str, asyncio.Future] = {}  # request id -> DeliverWindow message
        self.healthy = False  # True: serves a health check that says SERVING

    async def _maybe_fail(self, rpc, context):
        if rpc in self.fail:
            await context.abort(self.fail[rpc], f"{rpc} failed on purpose")

    async def PrepareReceive(self, request, context):
        self.calls.append(("PrepareReceive", request))
        await self._maybe_fail("PrepareReceive", context)
        end = resolve_kv_window_end(request.kv_window_end, len(request.prompt_token_ids))
        return pdserve_pb2.PrepareReceiveResponse(
            request_id=request.request_id, prefix_matched_length=min(self.matched, end),
            kv_window_end=end, kv_append_metadata=[1, 0, end - min(self.matched, end)],
            lease_id="lease-1", lease_ms=1000, decode_agent_name=f"agent-{self.name}")

    async def RemoteSend(self, request, context):
        if request.window_follows:  # overlap: the window comes in DeliverWindow
            future = self.windows.setdefault(request.request_id,
                                             asyncio.get_running_loop().create_future())
            try:
                window = await asyncio.wait_for(future, 10)
            except LookupError:  # aborted while waiting: nothing was written
                await context.abort(grpc.StatusCode.CANCELLED, "aborted before its window came")
            finally:
                self.windows.pop(request.request_id, None)
            merged = pdserve_pb2.RemoteSendRequest()
            merged.CopyFrom(request)
            for name in ("kv_window_begin", "kv_append_metadata", "lease_id", "decode_agent_name",
                         "decode_address", "lease_remaining_ms", "capability", "lease_ms",
                         "issued_unix_ms"):
                value = getattr(window, name)
                if name == "kv_append_metadata":
                    merged.kv_append_metadata[:] = value
                else:
                    setattr(merged, name, value)
            merged.window_follows = False  # recorded as the call it stands for
            request = merged
        self.calls.append(("RemoteSend", request))
        if self.remote_send_gate is not None:
            await self.remote_send_gate.wait()
        await self._maybe_fail("RemoteSend", context)
        return pdserve_pb2.RemoteSendResponse(request_id=request.request_id)

    async def DeliverWindow(self, request, context):
        future = self.windows.setdefault(request.request_id,
                                         asyncio.get_running_loop().create_future())
        if not future.done():
            future.set_result(request)
        return pdserve_pb2.DeliverWindowResponse(found=True)

    async def StartGeneration(self, request, context):
        if request.HasField("prepare"):  # local prefill in one call: a PrepareReceive first
            self.calls.append(("PrepareReceive", request.prepare))
            await self._maybe_fail("PrepareReceive", context)
        self.calls.append(("StartGeneration", request))
        await self._maybe_fail("StartGeneration", context)
        if self.stream_gate is not None:
            await self.stream_gate.wait()
        await self._maybe_fail("StartGeneration.stream", context)  # a failure once let through
        for i, t in enumerate(self.tokens):
            await asyncio.sleep(self.token_delay_s)
            last = i == len(self.tokens) - 1
            text = f"<{t}>" if self.texts is None else self.texts[i]
            yield pdserve_pb2.GenerateResponse(request_id=request.request_id, text=text,
                                               token_ids=[t], finish_reason=self.finish if last else "")
        yield pdserve_pb2.GenerateResponse(request_id=request.request_id, usage=pdserve_pb2.Usage(
            prompt_tokens=4, completion_tokens=len(self.tokens), total_tokens=4 + len(self.tokens)))

    async def Abort(self, request, context):
        self.aborted.append(request.request_id)
        future = self.windows.get(request.request_id)
        if future is not None and not future.done():
            future.set_exception(LookupError("aborted"))
        return pdserve_pb2.AbortResponse(found=True)

    def rpcs(self) -> list[str]:
        return [name for name, _ in self.calls]


async def start_fake(worker: FakeWorker) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    pdserve_pb2_grpc.add_WorkerServicer_to_server(worker, server)
    if worker.healthy:
        servicer = health.aio.HealthServicer()
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


class CharTokenizer:
    card = ModelCard(model="fake", vocab_size=256, max_model_len=128, eos_token_ids=[2])
    thinks = False  # no think tags (router/reasoning.py)
    harmony = False  # no channels (router/harmony.py)
    tool_dialect = HERMES  # router/tool_dialects.py

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(map(chr, ids))

    def token_text(self, token_id):
        return chr(token_id)


async def start_router(prefill: list[FakeWorker], decode: list[FakeWorker], tokenizer=None, **cfg):
    """A router (Generation service) over fake workers, with `tokenizer` (default
    CharTokenizer): (address, dispatcher, stop)."""
    servers, p_addr, d_addr = [], [], []
    for w, addrs in [*((w, p_addr) for w in prefill), *((w, d_addr) for w in decode)]:
        server, addr = await start_fake(w)
        servers.append(server)
        addrs.append(addr)
    config = RouterConfig(model="fake", prefill=p_addr, decode=d_addr, **cfg)
    registry = WorkerRegistry(p_addr, d_addr, RoundRobin(), RoundRobin())
    dispatcher = Dispatcher(config, registry)
    router = grpc.aio.server()
    pdserve_pb2_grpc.add_GenerationServicer_to_server(GenerationService(dispatcher, tokenizer or CharTokenizer()), router)
    port = router.add_insecure_port("127.0.0.1:0")
    await router.start()
    servers.append(router)

    async def stop():
        await registry.close()
        for s in servers:
            await s.stop(None)

    return f"127.0.0.1:{port}", dispatcher, stop


async def one_request(prefill: list[FakeWorker], decode: list[FakeWorker], request_id: str,
                      until=None, **cfg):
    """One "hello" through a router over these workers; with `until`, the router stays up
    until that awaitable is done (a call the router makes after the answer)."""
    from pdserve.client import AsyncClient

    addr, _, stop = await start_router(prefill, decode, **cfg)
    try:
        async with AsyncClient(addr) as client:
            out = await client.generate("hello", request_id=request_id)
        if until is not None:
            await asyncio.wait_for(until, 5)
    finally:
        await stop()
    return out


@contextlib.asynccontextmanager
async def openai_router(decode: list, tokenizer=None):
    """The OpenAI front (router/openai_http.py) of an in-process router over `decode` workers
    (fakes, or dead addresses given as strings), with `tokenizer` (default CharTokenizer):
    its base URL."""
    from pdserve.router.openai_http import OpenAIFrontend
    from pdserve.runtime.http import start_http

    servers, addresses = [], []
    for w in decode:
        if isinstance(w, str):
            addresses.append(w)
            continue
        server, address = await start_fake(w)
        servers.append(server)
        addresses.append(address)
    registry = WorkerRegistry([], addresses, RoundRobin(), RoundRobin())
    dispatcher = Dispatcher(RouterConfig(model="fake", decode=addresses, full_retry_s=0.1), registry)
    runner = await start_http(OpenAIFrontend(dispatcher, tokenizer or CharTokenizer(), "fake").app(),
                              "127.0.0.1", 0, "test")
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
        await registry.close()
        for s in servers:
            await s.stop(None)


@contextlib.contextmanager
def posting_to(tmp_path, path: str):
    """`post(body) -> (status, text)` to `path` of an in-process router over a fake decode
    node, with a chat tokenizer, its loop in a thread of its own (for callers that block,
    such as hypothesis tests)."""
    import json
    import threading
    import urllib.error
    import urllib.request

    from pdserve.engine.checkpoint import CHAT_TEMPLATE
    from pdserve.router.tokenizer import PromptTokenizer
    from tests.chat_checkpoint import write_tokenizer_only

    tokenizer = PromptTokenizer(str(write_tokenizer_only(tmp_path, CHAT_TEMPLATE)), "fake")
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    router = openai_router([FakeWorker("d")], tokenizer)
    url = asyncio.run_coroutine_threadsafe(router.__aenter__(), loop).result(30) + path

    def post(body: dict) -> tuple[int, str]:
        sent = json.dumps({"model": "fake", **body}).encode()
        try:
            with urllib.request.urlopen(urllib.request.Request(url, sent, {"Content-Type": "application/json"}),
                                        timeout=30) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    try:
        yield post
    finally:
        asyncio.run_coroutine_threadsafe(router.__aexit__(None, None, None), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def reached(condition, what: str, timeout_s: float = 20.0) -> None:
    """Poll `condition()` until it holds: the phase a test needs, reached however loaded the
    machine is (not by sleeping for a guessed time); fails naming `what` after `timeout_s`."""
    async def poll():
        while not condition():
            await asyncio.sleep(0.01)

    try:
        await asyncio.wait_for(poll(), timeout_s)
    except asyncio.TimeoutError:
        raise AssertionError(f"never reached: {what}") from None

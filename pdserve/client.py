"""pdserve's client library for the `pdserve.v1.Generation` service of a router or of a
colocated node: `AsyncClient` for asyncio code, `Client` for everything else (the same
calls, blocking).

    from pdserve.client import Client
    with Client("127.0.0.1:50051") as client:
        out = client.generate("Once upon a time", max_tokens=16, temperature=0)

- `generate(prompt or messages=..., **sampling) -> Completion`: every choice (`n`), token
  ids, text, finish reasons, logprobs (`logprobs=N`: each token's id, text and
  log-probability, and its N likeliest alternatives; `prompt_logprobs=N`: the same of the
  prompt's tokens), and `usage` with timings and route.
- `stream(...)`: `Delta`s as they come (each names its choice); the last carries `usage`.
- `abort(request_id)`, `models()`, `health()`.
- A prompt is text, token ids, or a conversation (`messages=[{"role", "content"}]`, which
  the server renders with the model's chat template). Sampling keywords are the fields of
  `SamplingParams` (max_tokens, temperature, top_p, top_k, min_p, seed, n, stop,
  stop_token_ids, ignore_eos, logprobs, prompt_logprobs, presence_penalty,
  frequency_penalty, repetition_penalty, logit_bias={token_id: bias}, min_tokens,
  bad_words=[...], include_stop_str_in_output, skip_special_tokens, allowed_token_ids=[...], and
  structured_output={"json_schema": TEXT} or {"json_object": True}, {"regex": TEXT},
  {"choice": {"choices": [...]}}, {"grammar": TEXT}); an unknown one is a TypeError before
  any call.
- Tools (with messages): `tools=[...]` (OpenAI's chat tools), `tool_choice`,
  `parallel_tool_calls`; an answer's calls are `Completion.tool_calls` (`ToolCall`: id,
  name, arguments as JSON text), its text the content around them. A later turn sends them
  back as an assistant message's `tool_calls`, each result as {"role": "tool",
  "tool_call_id", "content"}.
- `tls`: None (plaintext, unless this process configured `runtime.tls`, as the CLI does
  from its --tls-* flags), True (the system's CA roots), or `TLS(ca=..., cert=..., key=...)`
  (a private CA; cert and key for servers that require client certificates).
- `api_key`: sent as `authorization: Bearer`; by default `$PDSERVE_API_KEY` ("" sends none).
- Errors are `PdserveError` (gRPC status and the server's message). Retried, up to
  `retries` times with backoff, only what is safe to retry: the unary reads and Abort
  (idempotent) on UNAVAILABLE, and a Generate whose connection was never made (the server
  never saw it). A Generate that may have started is never retried.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.results import (Choice, Completion, Delta, Gather, Model, PdserveError, Route,
                             TokenLogprob, ToolCall, TopLogprob, Usage, delta_of)
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.runtime.bearer import bearer_metadata
from pdserve.runtime.server import GRPC_OPTIONS, channel

__all__ = ["AsyncClient", "Client", "TLS", "Completion", "Choice", "Delta", "Usage", "Route",
           "Model", "TokenLogprob", "TopLogprob", "ToolCall", "PdserveError"]

API_KEY_ENV = "PDSERVE_API_KEY"
SAMPLING_FIELDS = {f.name for f in pdserve_pb2.SamplingParams.DESCRIPTOR.fields}
RETRY_BACKOFF_S = 0.2
_NEVER_CONNECTED = ("failed to connect", "connection refused", "name resolution")


@dataclass(frozen=True)
class TLS:
    """Files of a TLS connection: the CA that signed the server's certificate, and this
    client's certificate and key for servers that require one (mutual TLS)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path):
            return Path(path).read_bytes() if path else None
        return grpc.ssl_channel_credentials(read(self.ca), read(self.key), read(self.cert))


def sampling_params(**kwargs) -> pdserve_pb2.SamplingParams:
    """SamplingParams from keyword arguments; None leaves a field at the server default."""
    unknown = set(kwargs) - SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"unknown sampling fields: {sorted(unknown)}")
    return pdserve_pb2.SamplingParams(**{k: v for k, v in kwargs.items() if v is not None})


def generate_request(prompt: str | list[int] | None = None, *,
                     messages: list[dict] | None = None, request_id: str = "",
                     kv_window_end: int | None = None, cache_salt: str = "", priority: int = 0,
                     tools: list[dict] | None = None, tool_choice: str = "",
                     parallel_tool_calls: bool | None = None, prompt_cache_key: str = "",
                     model: str = "", **sampling) -> pdserve_pb2.GenerateRequest:
    """A GenerateRequest of exactly one of `prompt` (text or token ids) or `messages`.
    A message's missing role or content stays unset: the server names it. `cache_salt`:
    only requests with the same salt (and tenant) share cached prompt prefixes; `priority`:
    lower waits less (as vLLM's); `prompt_cache_key`: requests with the same key go to the
    same nodes, to find each other's cached prefixes (as OpenAI's). `tools` (with
    messages): OpenAI's chat tools ({"type": "function", "function": {"name",
    "description", "parameters"}}, or the function alone), `tool_choice` "auto", "none",
    "required" or a tool's name. `model`: a LoRA adapter's name runs the request with it
    ("" or the model's own name: the model alone)."""
    if (prompt is None) == (messages is None):
        raise TypeError("give exactly one of prompt or messages")
    msg = pdserve_pb2.GenerateRequest(request_id=request_id, sampling=sampling_params(**sampling),
                                      cache_salt=cache_salt, priority=priority, tool_choice=tool_choice,
                                      prompt_cache_key=prompt_cache_key, model=model,
                                      tools=[tool_of(t) for t in tools or ()])
    if parallel_tool_calls is not None:
        msg.parallel_tool_calls = parallel_tool_calls
    if messages is not None:
        msg.messages.extend(chat_message(m) for m in messages)
    elif isinstance(prompt, str):
        msg.prompt = prompt
    else:
        msg.prompt_token_ids.extend(prompt)
    if kv_window_end is not None:
        msg.kv_window_end = kv_window_end
    return msg


def chat_message(message: dict) -> pdserve_pb2.ChatMessage:
    """One {"role", "content"} dict as a ChatMessage (a None content stays unset), with an
    assistant turn's `tool_calls` (OpenAI's shape, or `ToolCall`s as an answer gave them)
    and a tool turn's `tool_call_id`."""
    out = pdserve_pb2.ChatMessage(role=message.get("role") or "", tool_call_id=message.get("tool_call_id") or "")
    if message.get("content") is not None:
        out.content = message["content"]
    for call in message.get("tool_calls") or ():
        if isinstance(call, dict):
            function = call.get("function", call)
            call = ToolCall(call.get("id", ""), function.get("name", ""), function.get("arguments", ""))
        out.tool_calls.add(id=call.id, name=call.name, arguments=call.arguments)
    return out


def tool_of(tool: dict) -> pdserve_pb2.Tool:
    """An OpenAI chat tool (or its function alone) as a Tool; its parameters as JSON text."""
    function = tool.get("function", tool)
    parameters = function.get("parameters")
    return pdserve_pb2.Tool(name=function.get("name", ""), description=function.get("description") or "",
                            parameters="" if parameters is None else json.dumps(parameters))


def _never_connected(err: grpc.aio.AioRpcError) -> bool:
    details = (err.details() or "").lower()
    return err.code() == grpc.StatusCode.UNAVAILABLE and any(s in details for s in _NEVER_CONNECTED)


def _error(err: grpc.aio.AioRpcError, address: str) -> PdserveError:
    """`err` as a PdserveError; a server never reached is named, with what to check."""
    if _never_connected(err):
        return PdserveError(err.code(), f"no pdserve server answers at {address}: is it "
                                        f"running, and is that its host and port? "
                                        f"({err.details()})", err.trailing_metadata())
    return PdserveError.of(err)


class AsyncClient:
    def __init__(self, address: str, *, tls: bool | TLS | None = None,
                 api_key: str | None = None, timeout: float | None = None,
                 retries: int = 2) -> None:
        self.address, self.timeout, self.retries = address, timeout, retries
        api_key = os.environ.get(API_KEY_ENV) if api_key is None else api_key
        self.metadata = bearer_metadata(api_key) if api_key else None
        if tls is None or tls is False:
            self._channel = channel(address)  # plaintext, or the process's runtime.tls
        else:
            credentials = grpc.ssl_channel_credentials() if tls is True else tls.credentials()
            self._channel = grpc.aio.secure_channel(address, credentials, options=GRPC_OPTIONS)
        self.stub = pdserve_pb2_grpc.GenerationStub(self._channel)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    # ---- generation ------------------------------------------------------------------
    async def generate(self, prompt=None, *, timeout: float | None = None, **kwargs) -> Completion:
        """The whole answer: every choice, in index order, and the usage."""
        gather = Gather(kwargs.get("logprobs") is not None, kwargs.get("prompt_logprobs") is not None)
        async for delta in self.stream(prompt, timeout=timeout, **kwargs):
            gather.add(delta)
        return gather.result()

    async def stream(self, prompt=None, *, timeout: float | None = None, **kwargs
                     ) -> AsyncIterator[Delta]:
        """`Delta`s of every choice as the server sends them; the last one has `usage`."""
        with_logprobs = kwargs.get("logprobs") is not None
        async for msg in self.responses(prompt, timeout=timeout, **kwargs):
            yield delta_of(msg, with_logprobs)

    async def responses(self, prompt=None, *, timeout: float | None = None, **kwargs
                        ) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        """The raw `GenerateResponse` messages (what `stream` is made of)."""
        request = generate_request(prompt, **kwargs)
        for attempt in range(self.retries + 1):
            call = self.stub.Generate(request, timeout=self._timeout(timeout),
                                      metadata=self.metadata)
            received = False
            try:
                async for msg in call:
                    received = True
                    yield msg
                return
            except grpc.aio.AioRpcError as err:
                if received or attempt == self.retries or not _never_connected(err):
                    raise _error(err, self.address) from None
            finally:
                call.cancel()  # a consumer that stops early disconnects, freeing the request
            await asyncio.sleep(RETRY_BACKOFF_S * 2 ** attempt)

    # ---- the rest ----------------------------------------------------------------------
    async def abort(self, request_id: str) -> bool:
        """Stop a running request (its stream ends with finish_reason "abort"); whether the
        server knew it. A router answers NOT_FOUND for an id this key's tenant has not in
        flight: that is False here."""
        request = pdserve_pb2.AbortRequest(request_id=request_id)
        try:
            return (await self._unary(self.stub.Abort, request)).found
        except PdserveError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return False
            raise

    async def models(self) -> list[Model]:
        """The model served (one: pdserve serves one model per deployment)."""
        info = await self._unary(self.stub.GetModelInfo, pdserve_pb2.ModelInfoRequest())
        return [Model(info.model, info.vocab_size, info.max_model_len,
                      list(info.eos_token_ids), info.role)]

    async def health(self, service: str = "") -> str:
        """The server's gRPC health status: "SERVING", "NOT_SERVING", ..."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        reply = await self._unary(stub.Check, health_pb2.HealthCheckRequest(service=service))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def _unary(self, method, request):
        for attempt in range(self.retries + 1):
            try:
                return await method(request, timeout=self._timeout(None), metadata=self.metadata)
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.UNAVAILABLE or attempt == self.retries:
                    raise _error(err, self.address) from None
            await asyncio.sleep(RETRY_BACKOFF_S * 2 ** attempt)

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout


class Client:
    """`AsyncClient`'s calls, blocking: they run on an event loop of the client's own thread."""

    def __init__(self, address: str, **kwargs) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name=f"pdserve-client-{address}")
        self._thread.start()
        self._async = self._run(_make(address, kwargs))

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._loop.is_running():
            self._run(self._async.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def generate(self, prompt=None, **kwargs) -> Completion:
        return self._run(self._async.generate(prompt, **kwargs))

    def stream(self, prompt=None, **kwargs) -> Iterator[Delta]:
        deltas = self._async.stream(prompt, **kwargs)
        try:
            while True:
                try:
                    yield self._run(deltas.__anext__())
                except StopAsyncIteration:
                    return
        finally:  # also when the caller stops early: the call is cancelled on the server
            self._run(deltas.aclose())

    def abort(self, request_id: str) -> bool:
        return self._run(self._async.abort(request_id))

    def models(self) -> list[Model]:
        return self._run(self._async.models())

    def health(self, service: str = "") -> str:
        return self._run(self._async.health(service))

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()


async def _make(address: str, kwargs: dict) -> AsyncClient:
    return AsyncClient(address, **kwargs)  # its channel belongs to the client's loop

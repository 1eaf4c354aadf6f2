"""How one benchmark request is sent and timed: pdserve's gRPC `Generation.Generate`, or
any OpenAI-compatible `/v1/completions` endpoint streaming server-sent events.

A backend's `send` never raises for a failed request: it returns a `RequestResult` with
`ok=False` and the error, so one failure does not stop the run. Every request asks for
exactly `output_len` tokens (greedy, `ignore_eos`), so servers do the same work whatever
the model would have said.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from pdserve.benchmarks.serve.metrics import RequestResult
from pdserve.benchmarks.serve.workload import BenchRequest


@dataclass
class ModelLimits:
    vocab_size: int | None = None
    max_model_len: int | None = None
    model: str = ""  # served model name: a catalogue name or a checkpoint directory


class GrpcBackend:
    name = "grpc"

    def __init__(self, address: str, timeout_s: float | None = None) -> None:
        from pdserve.client import AsyncClient

        self.client = AsyncClient(address)
        self.timeout_s = timeout_s

    async def limits(self) -> ModelLimits:
        info = (await self.client.models())[0]
        return ModelLimits(info.vocab_size, info.max_model_len or None, info.id)

    async def send(self, req: BenchRequest) -> RequestResult:
        import grpc

        result = RequestResult(prompt_len=req.prompt_len, start=time.perf_counter())
        try:
            async for msg in self.client.responses(req.prompt, timeout=self.timeout_s,
                                                max_tokens=req.output_len, temperature=0.0,
                                                ignore_eos=True):
                if msg.HasField("usage"):
                    result.server_ttft_s = msg.usage.time_to_first_token_s
                    result.prompt_len = msg.usage.prompt_tokens or result.prompt_len
                elif msg.token_ids:
                    result.token_times.append(time.perf_counter())
                    result.output_tokens += len(msg.token_ids)
            result.ok = True
        except grpc.aio.AioRpcError as err:
            result.error = f"{err.code().name}: {err.details()}"
        result.end = time.perf_counter()
        return result

    async def close(self) -> None:
        await self.client.close()


def completions_url(url: str) -> str:
    """`http://host:port` or `.../v1` -> `.../v1/completions`; a URL already ending in
    `/completions` is kept."""
    url = url.rstrip("/")
    if url.endswith("/completions"):
        return url
    return url + ("/completions" if url.endswith("/v1") else "/v1/completions")


class OpenAIBackend:
    """Streams `POST /v1/completions`. Prompts go as token-id arrays (synthetic) or text.
    The output token count is the server's `usage.completion_tokens` when it sends one
    (`stream_options.include_usage`), else the number of chunks carrying text."""

    name = "openai"

    def __init__(self, url: str, model: str | None = None, timeout_s: float | None = None) -> None:
        import httpx

        self.url = completions_url(url)
        self.model = model
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s),
                                      limits=httpx.Limits(max_connections=None,
                                                          max_keepalive_connections=None))

    async def limits(self) -> ModelLimits:
        """The served model's name from `/v1/models` (when `model` was not given)."""
        if self.model is None:
            models_url = self.url.rsplit("/completions", 1)[0] + "/models"
            try:
                response = await self.http.get(models_url)
                self.model = response.json()["data"][0]["id"]
            except Exception as err:  # any failure: servers differ; say what to pass instead
                raise RuntimeError(f"cannot read the model name from {models_url} ({err}); "
                                   "pass --served-model") from None
        return ModelLimits(model=self.model)

    def payload(self, req: BenchRequest) -> dict:
        return {"model": self.model, "prompt": req.prompt, "max_tokens": req.output_len,
                "temperature": 0.0, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}

    async def send(self, req: BenchRequest) -> RequestResult:
        result = RequestResult(prompt_len=req.prompt_len, start=time.perf_counter())
        chunks, usage_tokens = 0, None
        try:
            async with self.http.stream("POST", self.url, json=self.payload(req)) as response:
                if response.status_code != 200:
                    body = (await response.aread()).decode(errors="replace")[:200]
                    raise RuntimeError(f"HTTP {response.status_code}: {body}")
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    choices = event.get("choices") or []
                    if choices and choices[0].get("text"):
                        result.token_times.append(time.perf_counter())
                        chunks += 1
                    if event.get("usage"):
                        usage_tokens = event["usage"].get("completion_tokens")
                        result.prompt_len = event["usage"].get("prompt_tokens") or result.prompt_len
            result.output_tokens = usage_tokens if usage_tokens is not None else chunks
            result.ok = True
        except Exception as err:  # httpx, JSON or HTTP status errors alike fail this request only
            result.error = f"{type(err).__name__}: {err}"
        result.end = time.perf_counter()
        return result

    async def close(self) -> None:
        await self.http.aclose()

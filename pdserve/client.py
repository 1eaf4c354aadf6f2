"""A small client for the `pdserve.v1.Generation` service (router or colocated node).

`Client.stream()` yields the raw `GenerateResponse` messages as they come;
`Client.complete()` gathers one whole answer into a `Completion`. A request's prompt is text,
token ids, or a conversation, `messages=[{"role": ..., "content": ...}]`, which the server
renders with the model's chat template (and stops at its end of turn). A server started
with an API key needs it on every call: `Client(address, api_key=...)`, by default
`$PDSERVE_API_KEY` (`api_key=""` sends none).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from google.protobuf.json_format import MessageToDict

from runtime.bearer import bearer_metadata
from runtime.server import channel
from proto import pdserve_pb2, pdserve_pb2_grpc

API_KEY_ENV = "PDSERVE_API_KEY"

SAMPLING_FIELDS = {f.name for f in pdserve_pb2.SamplingParams.DESCRIPTOR.fields}


def sampling_params(**kwargs) -> pdserve_pb2.SamplingParams:
    """SamplingParams from keyword arguments; None leaves a field at the server default."""
    unknown = set(kwargs) - SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"unknown sampling fields: {sorted(unknown)}")
    return pdserve_pb2.SamplingParams(**{k: v for k, v in kwargs.items() if v is not None})


@dataclass
class Completion:
    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    usage: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"request_id": self.request_id, "text": self.text, "token_ids": self.token_ids,
                "finish_reason": self.finish_reason, "usage": self.usage}


class Client:
    def __init__(self, address: str, api_key: str | None = None) -> None:
        self.address = address
        api_key = os.environ.get(API_KEY_ENV) if api_key is None else api_key
        self.metadata = bearer_metadata(api_key) if api_key else None
        self._channel = channel(address)
        self.stub = pdserve_pb2_grpc.GenerationStub(self._channel)

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    def request(self, prompt: str | list[int] | None = None, *,
                messages: list[dict] | None = None, request_id: str = "",
                kv_window_end: int | None = None, **sampling) -> pdserve_pb2.GenerateRequest:
        """A GenerateRequest of exactly one of `prompt` (text or token ids) or `messages`.
        A message's missing role or content stays unset: the server names it."""
        if (prompt is None) == (messages is None):
            raise TypeError("give exactly one of prompt or messages")
        msg = pdserve_pb2.GenerateRequest(request_id=request_id, sampling=sampling_params(**sampling))
        if messages is not None:
            msg.messages.extend(chat_message(m) for m in messages)
        elif isinstance(prompt, str):
            msg.prompt = prompt
        else:
            msg.prompt_token_ids.extend(prompt)
        if kv_window_end is not None:
            msg.kv_window_end = kv_window_end
        return msg

    async def stream(self, prompt=None, *, timeout: float | None = None, **kwargs
                     ) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        call = self.stub.Generate(self.request(prompt, **kwargs), timeout=timeout,
                                  metadata=self.metadata)
        try:
            async for msg in call:
                yield msg
        finally:
            call.cancel()  # a consumer that stops early disconnects, freeing the request

    async def complete(self, prompt=None, **kwargs) -> Completion:
        """The whole answer of choice 0 (other choices are ignored)."""
        out = Completion()
        async for msg in self.stream(prompt, **kwargs):
            out.request_id = msg.request_id
            if msg.HasField("usage"):
                out.usage = usage_dict(msg.usage)
            elif msg.index == 0:
                out.text += msg.text
                out.token_ids.extend(msg.token_ids)
                out.finish_reason = msg.finish_reason or out.finish_reason
        return out

    async def abort(self, request_id: str) -> bool:
        request = pdserve_pb2.AbortRequest(request_id=request_id)
        return (await self.stub.Abort(request, metadata=self.metadata)).found

    async def model_info(self) -> pdserve_pb2.ModelInfo:
        return await self.stub.GetModelInfo(pdserve_pb2.ModelInfoRequest(), metadata=self.metadata)


def chat_message(message: dict) -> pdserve_pb2.ChatMessage:
    """One {"role", "content"} dict as a ChatMessage (a None content stays unset)."""
    out = pdserve_pb2.ChatMessage(role=message.get("role") or "")
    if message.get("content") is not None:
        out.content = message["content"]
    return out


def usage_dict(usage: pdserve_pb2.Usage) -> dict:
    return MessageToDict(usage, preserving_proto_field_name=True,
                         always_print_fields_with_no_presence=True)

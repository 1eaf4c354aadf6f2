"""`--generation-timeout-s`: the router's optional bound on one generation, off by default
(0), so a request runs as long as its own max_tokens and its client's deadline allow.

The bound is no gRPC deadline on StartGeneration: a deadline would end the call with an
error, discard the text the client already has, and count against the decode node as if
it were gone. When the bound passes, the router stops reading D's stream (and aborts the
request there) and ends the stream itself, as max_tokens would have: every choice that
began ends with finish_reason "length", then one usage message counts what was generated.
A request with no token by then ends with DEADLINE_EXCEEDED naming the flag.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from pdserve.proto import pdserve_pb2
from pdserve.router.state import DispatchError


class LimitPassed(Exception):
    """The generation bound passed before D's stream ended."""


class GenerationLimit:
    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.ends = time.monotonic() + limit_s if limit_s > 0 else None

    async def read(self, call):
        """The next message of `call` (grpc.aio.EOF at its end); LimitPassed once the bound
        has passed."""
        if self.ends is None:
            return await call.read()
        left = self.ends - time.monotonic()
        if left <= 0:
            raise LimitPassed
        try:
            return await asyncio.wait_for(call.read(), left)
        except asyncio.TimeoutError:
            raise LimitPassed from None

    def no_token(self, request_id: str) -> DispatchError:
        return DispatchError(grpc.StatusCode.DEADLINE_EXCEEDED,
                             f"request {request_id} produced no token within the server's "
                             f"--generation-timeout-s ({self.limit_s:g} s); ask its operator "
                             f"to raise it (0: no limit)")


class StreamTally:
    """What one request's stream has carried so far, per choice."""

    def __init__(self) -> None:
        self.tokens: dict[int, int] = {}
        self.finished: set[int] = set()

    def add(self, msg: pdserve_pb2.GenerateResponse) -> None:
        if msg.HasField("usage"):
            return
        self.tokens[msg.index] = self.tokens.get(msg.index, 0) + len(msg.token_ids)
        if msg.finish_reason:
            self.finished.add(msg.index)

    def ending(self, request_id: str, usage: pdserve_pb2.Usage
               ) -> list[pdserve_pb2.GenerateResponse]:
        """The end of a stream the limit cut: "length" for each unfinished choice, then
        `usage` with the completion tokens counted here."""
        out = [pdserve_pb2.GenerateResponse(request_id=request_id, index=i, finish_reason="length")
               for i in sorted(set(self.tokens) - self.finished)]
        completion = sum(self.tokens.values())
        usage.completion_tokens = completion
        usage.total_tokens = usage.prompt_tokens + completion
        out.append(pdserve_pb2.GenerateResponse(request_id=request_id, usage=usage))
        return out

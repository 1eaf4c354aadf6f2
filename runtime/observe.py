"""Watching one request's token stream on one node: latency histograms, the outcome
counter and the request's log line.

`StreamObserver` sees every `GenerateResponse` a node sends for a request and, exactly once
when the stream ends (finished, failed or cancelled), records:
- time to first token (arrival -> first message with token ids), time per output token
  (first -> last token, over the tokens after the first of the longest choice), end-to-end;
- `requests_total{outcome}`: the finish reason of choice 0 when the stream ended normally
  ("stop", "length", "abort"), otherwise the gRPC status, lower case ("invalid_argument",
  "unavailable", "cancelled", ...);
- one `pdserve.request` log line with the request id, the timings and the usage.
`record_failure` counts and logs a request that failed before any stream began (a
PrepareReceive, a RemoteSend). Servicers call both explicitly, around the role's method.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc

from pdserve.runtime import metrics
from pdserve.runtime.errors import status_of
from pdserve.runtime.logs import log_request


def outcome_of(err: BaseException | None) -> str:
    """The gRPC status an error ends a request with, as a lower-case name."""
    if err is None:
        return "ok"
    code = status_of(err)
    if isinstance(err, grpc.aio.AioRpcError):
        code = err.code()
    elif isinstance(err, (asyncio.CancelledError, GeneratorExit)):
        code = grpc.StatusCode.CANCELLED
    return (code or grpc.StatusCode.INTERNAL).name.lower()


def record_failure(role: str, request_id: str, err: BaseException, **fields) -> str:
    """Count and log a request that ended on this node with `err`; its outcome."""
    outcome = outcome_of(err)
    metrics.REQUESTS.labels(role=role, outcome=outcome).inc()
    log_request(role, request_id, outcome, error=_describe(err), **fields)
    return outcome


class StreamObserver:
    def __init__(self, role: str, request_id: str, **fields) -> None:
        self.role = role
        self.request_id = request_id
        self.fields = fields  # extra log fields (api, phase timings known up front, ...)
        self.arrived = time.perf_counter()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.tokens_per_choice: dict[int, int] = {}
        self.finish_reasons: dict[int, str] = {}
        self.usage = None
        self.done = False

    def see(self, msg) -> None:
        if msg.token_ids:
            t = time.perf_counter()
            if self.first_token_at is None:
                self.first_token_at = t
            self.last_token_at = t
            self.tokens_per_choice[msg.index] = self.tokens_per_choice.get(msg.index, 0) + len(msg.token_ids)
        if msg.finish_reason:
            self.finish_reasons[msg.index] = msg.finish_reason
        if msg.HasField("usage"):
            self.usage = msg.usage

    def finish(self, outcome: str, error: str = "") -> None:
        """Record the request once; later calls do nothing."""
        if self.done:
            return
        self.done = True
        if outcome == "ok":
            outcome = self.finish_reasons.get(0, "ok")
        end = time.perf_counter()
        role = self.role
        metrics.REQUESTS.labels(role=role, outcome=outcome).inc()
        fields = dict(self.fields)
        e2e = end - self.arrived
        if not error:
            metrics.E2E.labels(role=role).observe(e2e)
        fields["e2e_s"] = e2e
        if self.first_token_at is not None:
            ttft = self.first_token_at - self.arrived
            metrics.TTFT.labels(role=role).observe(ttft)
            fields["ttft_s"] = ttft
            longest = max(self.tokens_per_choice.values())
            if longest > 1:
                tpot = (self.last_token_at - self.first_token_at) / (longest - 1)
                metrics.TPOT.labels(role=role).observe(tpot)
                fields["tpot_s"] = tpot
        completion = sum(self.tokens_per_choice.values())
        if self.usage is not None:
            u = self.usage
            completion = u.completion_tokens
            metrics.PROMPT_TOKENS.labels(role=role).inc(u.prompt_tokens)
            fields.update(prompt_tokens=u.prompt_tokens, cached_prompt_tokens=u.cached_prompt_tokens)
            if u.HasField("route"):
                self._route(u.route, fields)
        metrics.GENERATION_TOKENS.labels(role=role).inc(completion)
        fields["completion_tokens"] = completion
        if error:
            fields["error"] = error
        log_request(role, self.request_id, outcome, **fields)

    def _route(self, route, fields: dict) -> None:
        metrics.ROUTER_PREFIX_MATCHED.inc(route.prefix_matched_length)
        if route.remote_send_skipped:
            metrics.ROUTER_SKIPPED_SENDS.inc()
        fields.update(prefill=route.prefill_endpoint, decode=route.decode_endpoint,
                      prefix_matched=route.prefix_matched_length,
                      kv_window=f"{route.kv_window_begin}:{route.kv_window_end}",
                      remote_send_skipped=route.remote_send_skipped)

    async def watch(self, stream: AsyncIterator) -> AsyncIterator:
        """Pass `stream` through, seeing every message; record when it ends."""
        try:
            async for msg in stream:
                self.see(msg)
                yield msg
        except BaseException as err:
            self.finish(outcome_of(err), error=_describe(err))
            raise
        self.finish("ok")


def _describe(err: BaseException) -> str:
    if isinstance(err, (asyncio.CancelledError, GeneratorExit)):
        return "cancelled by the caller"
    return getattr(err, "message", None) or str(err) or type(err).__name__

"""Edge conversion of engine outputs into pdserve.v1 messages (decode and colocated).

`stream_responses` keeps the stream invariant of the protocol: every choice's last message
carries its finish_reason, and the stream ends with exactly one message carrying usage.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator

from pdserve.proto import pdserve_pb2


def _logprobs_pb(entries) -> list[pdserve_pb2.TokenLogprob]:
    out = []
    for e in entries or []:
        top = [pdserve_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in (e.top_logprobs or [])]
        out.append(pdserve_pb2.TokenLogprob(token_id=e.token_id, logprob=e.logprob or 0.0, top=top,
                                            rank=e.rank or 0))
    return out


def stop_reason_pb(reason: str | int | None) -> dict:
    """GenerateResponse's stop_reason field for an engine output's `stop_reason`."""
    if reason is None:
        return {}
    return {"stop_string": reason} if isinstance(reason, str) else {"stop_token_id": reason}


async def stream_responses(
    request_id: str, outputs: AsyncIterator, arrived: float
) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
    """Turn engine RequestOutput deltas into GenerateResponse messages, then usage."""
    ttft = 0.0
    prompt_tokens = cached = 0
    queued = prefill = 0.0
    completion: dict[int, int] = {}
    finished: set[int] = set()
    started: set[int] = set()  # choices sent a message: the prompt's logprobs went with it
    gaps = TokenGaps()
    async for out in outputs:
        prompt_tokens, cached = out.num_prompt_tokens, out.num_cached_tokens
        queued, prefill = out.queued_s, out.prefill_s
        for c in out.outputs:
            completion[c.index] = len(c.token_ids)
            if c.index in finished or not (c.new_token_ids or c.finish_reason):
                continue  # (a choice that ended is in every later delta of the request)
            if not ttft and c.new_token_ids:
                ttft = time.perf_counter() - arrived
            gaps.add(c.index, len(c.new_token_ids))
            n_new = len(c.new_token_ids)
            new_logprobs = c.logprobs[-n_new:] if c.logprobs and n_new else []
            first = c.index not in started
            started.add(c.index)
            yield pdserve_pb2.GenerateResponse(
                request_id=request_id, index=c.index, text=c.new_text,
                token_ids=c.new_token_ids, finish_reason=c.finish_reason or "",
                logprobs=_logprobs_pb(new_logprobs),
                prompt_logprobs=_logprobs_pb(out.prompt_logprobs if first else None),
                **stop_reason_pb(c.stop_reason))
            if c.finish_reason:
                finished.add(c.index)
        if out.finished:
            break
    for index in sorted(set(completion) - finished):  # cut short (aborted)
        yield pdserve_pb2.GenerateResponse(request_id=request_id, index=index, finish_reason="abort")
    total_completion = sum(completion.values())
    yield pdserve_pb2.GenerateResponse(request_id=request_id, usage=pdserve_pb2.Usage(
        prompt_tokens=prompt_tokens, completion_tokens=total_completion,
        total_tokens=prompt_tokens + total_completion,
        time_to_first_token_s=ttft or time.perf_counter() - arrived,
        cached_prompt_tokens=cached, queue_time_s=queued, prefill_time_s=prefill,
        time_per_output_token_s=gaps.mean(), time_per_output_token_p90_s=gaps.quantile(0.9)))


class TokenGaps:
    """Time between each choice's successive output tokens, as they are streamed (a delta
    of k tokens counts as k gaps of a k-th of the time since the choice's last delta)."""

    def __init__(self) -> None:
        self._last: dict[int, float] = {}
        self._gaps: list[float] = []

    def add(self, index: int, num_tokens: int) -> None:
        if not num_tokens:
            return
        now = time.perf_counter()
        last = self._last.get(index)
        if last is not None:
            self._gaps += [(now - last) / num_tokens] * num_tokens
        self._last[index] = now

    def mean(self) -> float:
        return sum(self._gaps) / len(self._gaps) if self._gaps else 0.0

    def quantile(self, q: float) -> float:
        """The nearest-rank `q` quantile (0 without gaps)."""
        if not self._gaps:
            return 0.0
        ordered = sorted(self._gaps)
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

"""Edge conversion between pdserve.v1 messages and engine objects (decode and colocated).

`stream_responses` keeps the stream invariant of the protocol: every choice's last message
carries its finish_reason, and the stream ends with exactly one message carrying usage.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from engine import SamplingParams
from proto import pdserve_pb2


def sampling_from_pb(pb: pdserve_pb2.SamplingParams) -> SamplingParams:
    """Engine SamplingParams; unset optional fields keep the engine defaults. Not checked
    here: the role checks them by the engine's rules (`SamplingParams.validate`)."""
    d = SamplingParams()

    def given(name: str, default):
        return getattr(pb, name) if pb.HasField(name) else default

    return SamplingParams(
        max_tokens=given("max_tokens", d.max_tokens), temperature=given("temperature", d.temperature),
        top_p=given("top_p", d.top_p), top_k=given("top_k", d.top_k), min_p=pb.min_p,
        seed=given("seed", d.seed), n=given("n", d.n), stop=list(pb.stop),
        stop_token_ids=list(pb.stop_token_ids), ignore_eos=pb.ignore_eos,
        logprobs=given("logprobs", d.logprobs))


def _logprobs_pb(entries) -> list[pdserve_pb2.TokenLogprob]:
    out = []
    for e in entries or []:
        top = [pdserve_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in (e.top_logprobs or [])]
        out.append(pdserve_pb2.TokenLogprob(token_id=e.token_id, logprob=e.logprob or 0.0, top=top))
    return out


async def stream_responses(
    request_id: str, outputs: AsyncIterator, arrived: float
) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
    """Turn engine RequestOutput deltas into GenerateResponse messages, then usage."""
    ttft = 0.0
    prompt_tokens = cached = 0
    completion: dict[int, int] = {}
    finished: set[int] = set()
    async for out in outputs:
        prompt_tokens, cached = out.num_prompt_tokens, out.num_cached_tokens
        for c in out.outputs:
            completion[c.index] = len(c.token_ids)
            if not c.new_token_ids and not c.finish_reason:
                continue
            if not ttft and c.new_token_ids:
                ttft = time.perf_counter() - arrived
            n_new = len(c.new_token_ids)
            new_logprobs = c.logprobs[-n_new:] if c.logprobs and n_new else []
            yield pdserve_pb2.GenerateResponse(
                request_id=request_id, index=c.index, text=c.new_text,
                token_ids=c.new_token_ids, finish_reason=c.finish_reason or "",
                logprobs=_logprobs_pb(new_logprobs))
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
        cached_prompt_tokens=cached))

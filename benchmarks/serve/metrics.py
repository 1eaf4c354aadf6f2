"""Serving metrics from per-request timelines, as the client saw them.

Definitions (the same as vLLM's `benchmark_serving`, so numbers compare):
- TTFT: from sending the request to receiving its first output token.
- TPOT: per request, (last token time - first token time) / (output tokens - 1); a request
  with a single output token has none.
- ITL: the gap between two consecutive streamed messages that carry tokens, pooled over
  all requests (a message carrying several tokens is one gap).
- E2E latency: from sending the request to the end of its stream.
- Throughput: completed requests, or output tokens, per second of the run; the run lasts
  from its first send to its last completion.
- Goodput: completed requests per second that meet every objective given: TTFT, TPOT and
  the p99 of the request's own ITLs (a request without a TPOT or gaps meets those two).
  Its fraction is over every request sent, failed ones included.
Failed requests count in `failed` and in nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    start: float = 0.0                                       # perf_counter at send
    end: float = 0.0                                         # perf_counter at stream end
    token_times: list[float] = field(default_factory=list)   # one per message with tokens
    server_ttft_s: float | None = None                       # as the server reported it

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def tpot(self) -> float | None:
        if len(self.token_times) < 2 or self.output_tokens < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return list(np.diff(self.token_times)) if len(self.token_times) > 1 else []

    @property
    def itl_p99(self) -> float | None:
        """The p99 of this request's own gaps (linear interpolation); None without gaps."""
        gaps = self.itls
        return float(np.percentile(gaps, 99)) if gaps else None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict:
        return {"ok": self.ok, "error": self.error, "prompt_len": self.prompt_len,
                "output_tokens": self.output_tokens, "ttft_s": self.ttft, "tpot_s": self.tpot,
                "e2e_s": self.e2e if self.ok else None, "server_ttft_s": self.server_ttft_s}


def distribution(values_s: list[float]) -> dict[str, float | None]:
    """Mean, median, p90 and p99 in milliseconds (linear interpolation between ranks);
    all None when there are no values."""
    if not values_s:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    ms = np.asarray(values_s, dtype=float) * 1000.0
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {"mean": float(ms.mean()), "median": float(p50), "p90": float(p90), "p99": float(p99)}


def meets(result: RequestResult, ttft_s: float | None, tpot_s: float | None,
          itl_p99_s: float | None = None) -> bool:
    """Whether a completed request meets every objective (None: no objective)."""
    if not result.ok:
        return False
    if ttft_s is not None and result.ttft is not None and result.ttft > ttft_s:
        return False
    if itl_p99_s is not None and (result.itl_p99 or 0.0) > itl_p99_s:
        return False
    tpot = result.tpot
    return tpot_s is None or tpot is None or tpot <= tpot_s


def goodput(results: list[RequestResult], duration_s: float, ttft_s: float | None,
            tpot_s: float | None, itl_p99_s: float | None = None) -> float:
    """Requests per second meeting every objective."""
    if duration_s <= 0:
        return 0.0
    return sum(meets(r, ttft_s, tpot_s, itl_p99_s) for r in results) / duration_s


@dataclass(frozen=True)
class Objectives:
    """Fixed service-level objectives (`--slo-*`), the same on every day and system."""
    ttft_s: float | None = None
    tpot_ms: float | None = None
    itl_p99_ms: float | None = None

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value is not None and not value > 0:
                raise ValueError(f"objective {name} must be a positive number, got {value!r}")

    def given(self) -> bool:
        return any(v is not None for v in vars(self).values())

    def goodput(self, results: list[RequestResult], duration_s: float) -> dict:
        """`goodput` (req/s), `good_requests` and `goodput_fraction` (of every request sent)."""
        ms = lambda v: None if v is None else v / 1000  # noqa: E731
        good = sum(meets(r, self.ttft_s, ms(self.tpot_ms), ms(self.itl_p99_ms)) for r in results)
        return {"goodput": good / duration_s if duration_s > 0 else 0.0, "good_requests": good,
                "goodput_fraction": good / len(results) if results else None}


def run_duration(results: list[RequestResult]) -> float:
    """From the first send to the last completion, in seconds."""
    done = [r for r in results if r.end]
    if not done:
        return 0.0
    return max(r.end for r in done) - min(r.start for r in results)


def summarize(results: list[RequestResult], duration_s: float | None = None) -> dict:
    """Every metric of one run. Latencies are `{mean, median, p90, p99}` in ms."""
    duration = run_duration(results) if duration_s is None else duration_s
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(in_tokens + out_tokens),
        "ttft_ms": distribution([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": distribution([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": distribution([gap for r in ok for gap in r.itls]),
        "e2e_ms": distribution([r.e2e for r in ok]),
        "server_ttft_ms": distribution([r.server_ttft_s for r in ok if r.server_ttft_s is not None]),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }

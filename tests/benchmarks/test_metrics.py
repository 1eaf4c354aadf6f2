"""Metric definitions on hand-built timelines: every expected number is worked out here."""

import pytest

from pdserve.benchmarks.serve.metrics import RequestResult, distribution, goodput, meets, summarize


def timeline(start, token_times, output_tokens=None, ok=True, end=None, prompt_len=10):
    return RequestResult(ok=ok, prompt_len=prompt_len, start=start, token_times=list(token_times),
                         output_tokens=len(token_times) if output_tokens is None else output_tokens,
                         end=end if end is not None else (token_times[-1] if token_times else start))


def test_ttft_tpot_itl_and_e2e_of_one_request():
    r = timeline(10.0, [10.5, 10.6, 10.8, 11.1], end=11.2)
    assert r.ttft == pytest.approx(0.5)
    # (last - first) / (tokens - 1) = 0.6 / 3
    assert r.tpot == pytest.approx(0.2)
    assert r.itls == pytest.approx([0.1, 0.2, 0.3])
    assert r.e2e == pytest.approx(1.2)


def test_tpot_counts_tokens_not_messages_when_a_message_carries_several():
    # Two messages of 3 and 2 tokens: ITL has one gap, TPOT spreads it over 4 token steps.
    r = timeline(0.0, [1.0, 1.8], output_tokens=5)
    assert r.itls == pytest.approx([0.8])
    assert r.tpot == pytest.approx(0.2)


def test_single_token_request_has_no_tpot_and_meets_any_tpot_objective():
    r = timeline(0.0, [0.3])
    assert r.tpot is None and r.itls == []
    assert meets(r, ttft_s=0.5, tpot_s=0.001)
    assert not meets(r, ttft_s=0.2, tpot_s=None)


def test_distribution_uses_linear_interpolation_in_ms():
    d = distribution([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert d["mean"] == pytest.approx(50.5)
    assert d["median"] == pytest.approx(50.5)
    assert d["p90"] == pytest.approx(90.1)
    assert d["p99"] == pytest.approx(99.01)
    assert distribution([]) == {"mean": None, "median": None, "p90": None, "p99": None}


def test_goodput_needs_both_objectives_and_ignores_failures():
    results = [
        timeline(0.0, [0.1, 0.2, 0.3]),            # ttft 0.1, tpot 0.1: good
        timeline(0.0, [0.5, 0.6, 0.7]),            # ttft 0.5: too slow to start
        timeline(0.0, [0.1, 0.5, 0.9]),            # tpot 0.4: too slow per token
        timeline(0.0, [0.1, 0.2], ok=False),       # failed: never good
    ]
    assert goodput(results, 2.0, ttft_s=0.2, tpot_s=0.2) == pytest.approx(0.5)
    assert goodput(results, 2.0, ttft_s=None, tpot_s=0.2) == pytest.approx(1.0)
    assert goodput(results, 2.0, ttft_s=None, tpot_s=None) == pytest.approx(1.5)


def test_summary_throughput_spans_first_send_to_last_completion():
    results = [timeline(0.0, [1.0, 2.0], end=2.0), timeline(1.0, [2.0, 3.0, 4.0], end=4.0),
               RequestResult(ok=False, error="UNAVAILABLE: gone", start=0.5, end=0.6)]
    s = summarize(results)
    assert s["duration_s"] == pytest.approx(4.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["request_throughput"] == pytest.approx(0.5)
    assert s["output_throughput"] == pytest.approx(5 / 4)
    assert s["ttft_ms"]["mean"] == pytest.approx(1000.0)
    assert s["tpot_ms"]["median"] == pytest.approx(1000.0)
    # ITL pools gaps of all requests: 1.0, 1.0, 1.0
    assert s["itl_ms"]["p99"] == pytest.approx(1000.0)
    assert s["e2e_ms"]["median"] == pytest.approx(2500.0)
    assert s["errors"] == ["UNAVAILABLE: gone"]

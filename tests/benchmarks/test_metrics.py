"""Metric definitions on hand-built timelines: every expected number is worked out here."""

import pytest

from pdserve.benchmarks.serve.metrics import (Objectives, RequestResult, distribution, goodput, meets,
                                              summarize)


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


def test_a_requests_itl_p99_is_over_its_own_gaps():
    r = timeline(0.0, [0.1 * i for i in range(1, 102)])   # 100 gaps of 0.1 s
    slow = timeline(0.0, [0.1, 0.2, 3.2, 3.3])             # gaps 0.1, 3.0, 0.1
    assert r.itl_p99 == pytest.approx(0.1)
    assert slow.itl_p99 == pytest.approx(0.1 + 0.98 * 2.9)  # linear between ranks 1 and 2
    assert timeline(0.0, [0.3]).itl_p99 is None


def test_fixed_objectives_count_requests_meeting_every_one_given_over_all_sent():
    results = [
        timeline(0.0, [1.0, 1.1, 1.2]),                    # ttft 1, tpot 100 ms, gaps 100 ms
        timeline(0.0, [70.0, 70.1, 70.2]),                 # ttft 70 s: misses TTFT
        timeline(0.0, [1.0, 1.5, 2.0]),                    # tpot 500 ms: misses TPOT
        timeline(0.0, [1.0, 1.01, 1.4]),                   # tpot 200 ms, a 390 ms gap
        timeline(0.0, [1.0, 1.1], ok=False),               # failed: never good, still counted
    ]
    both = Objectives(ttft_s=60, tpot_ms=200)
    assert both.goodput(results, 10.0) == {"goodput": pytest.approx(0.2), "good_requests": 2,
                                           "goodput_fraction": pytest.approx(0.4)}
    with_itl = Objectives(ttft_s=60, tpot_ms=200, itl_p99_ms=300)
    assert with_itl.goodput(results, 10.0)["good_requests"] == 1
    assert Objectives(tpot_ms=200).goodput(results, 10.0)["good_requests"] == 3
    assert Objectives().given() is False and both.given() is True
    assert Objectives().goodput([], 0.0) == {"goodput": 0.0, "good_requests": 0,
                                            "goodput_fraction": None}


@pytest.mark.parametrize("bad", [0, -1.0, float("nan")])
def test_an_objective_must_be_positive_and_the_error_names_it(bad):
    with pytest.raises(ValueError, match=r"tpot_ms must be a positive number, got"):
        Objectives(ttft_s=60, tpot_ms=bad)

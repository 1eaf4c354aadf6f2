"""Workload generators: deterministic for a seed, in range, and ShareGPT parsing."""

import json
import statistics

import pytest

from pdserve.benchmarks.serve.workload import (LOW_TOKEN_ID, arrival_offsets, parse_range, read_sharegpt,
                                    sample_sharegpt, synthetic)


def test_synthetic_prompts_are_a_function_of_the_seed():
    a = synthetic(20, (5, 9), (2, 4), vocab_size=50, seed=3)
    assert a == synthetic(20, (5, 9), (2, 4), vocab_size=50, seed=3)
    assert a != synthetic(20, (5, 9), (2, 4), vocab_size=50, seed=4)
    for r in a:
        assert 5 <= r.prompt_len <= 9 and len(r.prompt) == r.prompt_len
        assert 2 <= r.output_len <= 4
        assert all(LOW_TOKEN_ID <= t < 50 for t in r.prompt)
    assert {r.prompt_len for r in a} == set(range(5, 10))  # the whole range is used


def test_arrivals_fixed_poisson_and_unbounded():
    assert arrival_offsets(4, 2.0, "fixed") == [0.0, 0.5, 1.0, 1.5]
    assert arrival_offsets(3, float("inf")) == [0.0, 0.0, 0.0]
    p = arrival_offsets(4000, 4.0, "poisson", seed=1)
    assert p == arrival_offsets(4000, 4.0, "poisson", seed=1)
    gaps = [b - a for a, b in zip(p, p[1:])]
    assert p[0] == 0.0 and min(gaps) >= 0
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.1)  # exponential: sd = mean
    # The same seed at another rate gives the same draws, scaled.
    assert arrival_offsets(5, 2.0, "poisson", seed=1) == pytest.approx(
        [2 * t for t in arrival_offsets(5, 4.0, "poisson", seed=1)])


def test_parse_range():
    assert parse_range("512:1536") == (512, 1536)
    assert parse_range("64") == (64, 64)
    for bad in ("0:5", "9:3", "a:b", "1:2:3"):
        with pytest.raises(ValueError, match=bad):
            parse_range(bad)


def test_sharegpt_takes_first_turns_and_filters_like_vllm(tmp_path):
    words = lambda n: " ".join(["w"] * n)  # noqa: E731
    data = [
        {"id": "ok1", "conversations": [{"from": "human", "value": words(10)},
                                        {"from": "gpt", "value": words(20)},
                                        {"from": "human", "value": words(99)}]},
        {"id": "ok2", "conversations": [{"from": "human", "value": words(6)},
                                        {"from": "gpt", "value": words(5)}]},
        {"id": "short-answer", "conversations": [{"from": "human", "value": words(10)},
                                                 {"from": "gpt", "value": words(2)}]},
        {"id": "too-long", "conversations": [{"from": "human", "value": words(90)},
                                             {"from": "gpt", "value": words(20)}]},
        {"id": "gpt-first", "conversations": [{"from": "gpt", "value": words(10)},
                                              {"from": "human", "value": words(10)}]},
        {"id": "one-turn", "conversations": [{"from": "human", "value": words(10)}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    pairs = read_sharegpt(path)
    assert len(pairs) == 4
    count = lambda text: len(text.split())  # noqa: E731
    got = sample_sharegpt(pairs, 10, count, seed=0, max_model_len=100)
    assert sorted((r.prompt_len, r.output_len) for r in got) == [(6, 5), (10, 20)]
    assert all(isinstance(r.prompt, str) for r in got)
    fixed = sample_sharegpt(pairs, 10, count, seed=0, max_model_len=100, output_len=7)
    # A fixed output length also changes what fits: 90 + 7 <= 100.
    assert sorted((r.prompt_len, r.output_len) for r in fixed) == [(6, 7), (10, 7), (10, 7), (90, 7)]
    assert sample_sharegpt(pairs, 1, count, seed=5) == sample_sharegpt(pairs, 1, count, seed=5)


def test_sharegpt_rejects_a_file_that_is_not_a_list(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"conversations": []}')
    with pytest.raises(ValueError, match="JSON list"):
        read_sharegpt(path)

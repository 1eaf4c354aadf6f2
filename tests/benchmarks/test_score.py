"""`pdserve bench score --quick --json` scores the prompts with pdserve and transformers,
times pdserve's unscored prefill beside them, and finds both engines' logprobs the same."""

from __future__ import annotations

import json

import pytest

from pdserve.benchmarks import score as bench


def test_quick_score_bench_reports_both_engines_and_their_agreement(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    assert bench.main(["--quick", "--json", "--model", "bench-random-tiny", "--top", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["name"] == "bench-random-tiny" and report["quick"] is True
    prompts = bench.make_prompts(8, 1024, quick=True)
    assert (report["num_prompts"], report["prompt_tokens"]) == (8, sum(map(len, prompts)))
    for engine in ("pdserve_score", "pdserve_prefill", "transformers_score"):
        assert report[f"{engine}_tokens_per_s"] > 0
    assert report["score_vs_prefill"] == pytest.approx(
        report["pdserve_score_tokens_per_s"] / report["pdserve_prefill_tokens_per_s"], rel=0.01)
    assert report["speedup_vs_transformers"] == pytest.approx(
        report["pdserve_score_tokens_per_s"] / report["transformers_score_tokens_per_s"], rel=0.01)
    assert report["max_abs_logprob_diff"] < 1e-4  # fp32, the same tokens scored alike

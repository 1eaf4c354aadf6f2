"""`pdserve bench penalties --quick --json` times pdserve with and without penalties and
transformers with them, and finds pdserve's tokens the same as transformers'."""

from __future__ import annotations

import json

import pytest

from pdserve.benchmarks import penalties as bench


def test_quick_penalties_bench_reports_both_engines_and_their_agreement(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    assert bench.main(["--quick", "--json", "--model", "bench-random-tiny"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["name"] == "bench-random-tiny" and report["quick"] is True
    assert (report["num_prompts"], report["new_tokens_each"]) == (4, 8)
    for engine in ("pdserve_penalized", "pdserve_plain", "transformers_penalized"):
        assert report[f"{engine}_tokens_per_s"] > 0
    assert report["penalized_vs_plain"] == pytest.approx(
        report["pdserve_penalized_tokens_per_s"] / report["pdserve_plain_tokens_per_s"], rel=0.01)
    assert report["speedup_vs_transformers"] == pytest.approx(
        report["pdserve_penalized_tokens_per_s"] / report["transformers_penalized_tokens_per_s"], rel=0.01)
    assert report["matching_prompts"] == 4  # fp32, the same rules on the same logits

"""`pdserve bench constrained --quick --json` times pdserve plain, under penalties and under
bans and two structured outputs, and transformers under the same rules, and finds pdserve's tokens
the same as transformers'."""

from __future__ import annotations

import json

import pytest

from pdserve.benchmarks import constrained as bench


def test_quick_constrained_bench_reports_every_rule_against_plain_and_transformers(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    assert bench.main(["--quick", "--json", "--model", "bench-random-tiny"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["name"] == "bench-random-tiny" and report["quick"] is True
    assert (report["num_prompts"], report["new_tokens_each"]) == (4, 8)
    assert report["pdserve_plain_tokens_per_s"] > 0
    for rule in ("penalties", "bans", "regex", "json"):
        assert report[f"pdserve_{rule}_tokens_per_s"] > 0 and report[f"transformers_{rule}_tokens_per_s"] > 0
        assert report[f"{rule}_vs_plain"] == pytest.approx(
            report[f"pdserve_{rule}_tokens_per_s"] / report["pdserve_plain_tokens_per_s"], rel=0.01)
        assert report[f"{rule}_speedup_vs_transformers"] == pytest.approx(
            report[f"pdserve_{rule}_tokens_per_s"] / report[f"transformers_{rule}_tokens_per_s"], rel=0.01)
        assert report[f"{rule}_matching_prompts"] == 4, rule  # fp32, the same rules on the same logits
        assert report[f"{rule}_full_length"] is True, rule

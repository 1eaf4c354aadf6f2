"""`pdserve bench engine --quick --json` runs both engines and reports every figure."""

from __future__ import annotations

import json

import pytest

from benchmarks import engine as bench


def test_quick_bench_reports_both_throughputs_and_speedup(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    assert bench.main(["--quick", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"model", "dtype", "threads", "quick", "workloads"} <= report.keys()
    assert report["dtype"] == "float32" and report["quick"] is True
    assert [w["workload"] for w in report["workloads"]] == ["mixed", "uniform"]
    for w in report["workloads"]:
        for key in ("num_prompts", "prompt_tokens", "generated_tokens", "engine_s", "transformers_s",
                    "engine_tokens_per_s", "transformers_tokens_per_s", "speedup", "greedy_match"):
            assert key in w, key
        assert w["engine_tokens_per_s"] > 0 and w["transformers_tokens_per_s"] > 0
        ratio = w["engine_tokens_per_s"] / w["transformers_tokens_per_s"]
        assert w["speedup"] == pytest.approx(ratio, rel=0.01)
        # fp32 greedy on a tiny model: both engines pick the same tokens.
        assert w["greedy_match"] == 1.0

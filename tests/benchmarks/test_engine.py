"""`pdserve bench engine --quick --json` runs both engines and reports every figure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import engine as bench


def test_quick_bench_reports_both_throughputs_and_speedup(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    assert bench.main(["--quick", "--json", "--model", "bench-random-tiny"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"model", "dtype", "threads", "quick", "workloads"} <= report.keys()
    assert report["dtype"] == "float32" and report["quick"] is True
    # The model measured: its name, the directory both engines loaded (written into the
    # cache on first use) and the dtype they ran in.
    model = report["model"]
    assert (model["name"], model["dtype"]) == ("bench-random-tiny", "float32")
    assert Path(model["dir"]).parent == tmp_path and Path(model["dir"], "config.json").exists()
    assert model["vocab_size"] == 1024 and model["parameters"] > 0
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


def test_workloads_fit_the_real_models_vocabulary_and_context():
    for quick in (False, True):
        for w in bench.make_workloads(["mixed", "uniform"], 49152, quick):
            assert all(bench.FIRST_PROMPT_TOKEN <= t < 49152 for p in w.prompts for t in p)
            assert max(len(p) + n for p, n in zip(w.prompts, w.output_lens)) <= 8192


def test_the_kv_cache_holds_every_context_of_the_largest_workload_at_once():
    from types import SimpleNamespace

    smollm2 = SimpleNamespace(num_hidden_layers=30, num_key_value_heads=3, head_dim=64,
                              hidden_size=576, num_attention_heads=9)
    workloads = bench.make_workloads(["mixed", "uniform"], 49152, quick=False)
    tokens = sum(len(p) + n for p, n in zip(workloads[0].prompts, workloads[0].output_lens))
    fp32 = bench.kv_cache_bytes(smollm2, "float32", workloads, page_size=16)
    assert fp32 >= tokens * 2 * 30 * 3 * 64 * 4
    assert bench.kv_cache_bytes(smollm2, "bfloat16", workloads, page_size=16) == fp32 // 2

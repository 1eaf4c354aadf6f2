"""`pdserve bench lora`: its adapters are ones the engine serves, its ratios are to the base
measured in the same run, and a smoke run on a random tiny model reports every mode. What
adapters cost is measured by the bench, not asserted here."""

from __future__ import annotations

import json

import pytest

from pdserve.benchmarks import lora as bench


def test_the_report_gives_each_mode_and_its_ratio_to_the_base():
    out = bench.report_of({"base": 100.0, "one": 80.0, "mixed": 50.0})
    assert out == {"base_tok_s": 100.0, "one_tok_s": 80.0, "mixed_tok_s": 50.0, "one_vs_base": 0.8,
                   "mixed_vs_base": 0.5}


def test_its_adapter_changes_the_output_as_peft_computes_it(tmp_path):
    from pdserve.engine import LLM
    from pdserve.engine.checkpoint import write_checkpoint
    from tests.engine.test_lora import peft_greedy, run_all

    model = write_checkpoint(tmp_path / "m", family="llama")
    adapter = bench.write_adapter(model, tmp_path / "a", rank=4, seed=0)
    llm = LLM(model, lora_modules=[f"a={adapter}"], page_size=4, num_pages=64)
    prompt = list(range(3, 20))
    ours = run_all(llm.engine, [(prompt, "a")])
    assert ours == [peft_greedy(model, adapter, prompt)] and ours != [peft_greedy(model, None, prompt)]


def test_a_smoke_run_reports_every_mode(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    out = tmp_path / "lora.json"
    assert bench.main(["--model", "bench-random-tiny", "--adapters", "2", "--rank", "4", "--requests", "3",
                       "--prompt-tokens", "8", "--max-tokens", "3", "--rounds", "1", "--json", "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == json.loads(out.read_text())
    assert report["model"]["name"] == "bench-random-tiny"
    assert all(report[f"{m}_tok_s"] > 0 for m in bench.MODES)
    assert report["mixed_vs_base"] == pytest.approx(report["mixed_tok_s"] / report["base_tok_s"], rel=0.01)

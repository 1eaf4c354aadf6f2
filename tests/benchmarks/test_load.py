"""`pdserve bench load` starts the engine on one rank and on N, each in a process of its
own, and reports each start's memory beside the weights it must hold."""

from __future__ import annotations

import json

from pdserve.benchmarks import load


def test_a_run_reports_both_starts_against_the_weights(tiny_model, capsys):
    assert load.main(["--model", tiny_model, "--tensor-parallel-size", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["weights_bytes"] == load.weights_bytes(tiny_model, "float32") > 0
    assert [report["baseline"]["ranks"], report["tp"]["ranks"]] == [1, 2]
    for run in (report["baseline"], report["tp"]):
        assert 0 < run["serving_bytes"] <= run["peak_bytes"] and run["start_s"] > 0
        assert run["serving_over_weights"] == round(run["serving_bytes"] / report["weights_bytes"], 3)
    assert report["tp_serving_over_baseline"] == round(report["tp"]["serving_bytes"] / report["baseline"]["serving_bytes"], 3)


def test_one_rank_is_refused_naming_the_baseline(tiny_model, capsys):
    assert load.main(["--model", tiny_model, "--tensor-parallel-size", "1"]) == 2
    assert "must be at least 2 (1 is the baseline's)" in capsys.readouterr().err

"""`pdserve bench host` times the host's side of the GPU's decode step (the graphs' inputs,
sampling's host half, overlapped text) on the CPU, with the byte-level detokenizer and,
in the same run, tokenizers' own decode."""

from __future__ import annotations

import json

import pytest

from pdserve.benchmarks import host_step


def test_host_report_times_every_step_on_the_graphs_path_against_the_baseline(tiny_model, capsys):
    argv = ["--model", tiny_model, "--batches", "1,5", "--steps", "6", "--prompt-len", "8"]
    assert host_step.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["detokenizer"] == "byte-level" and report["steps"] == 6
    assert set(report["batches"]) == {"1", "5"}
    for row in report["batches"].values():
        for figures in (row, row["baseline"]):
            assert figures["graph_steps"] == 6  # every timed step replayed (the host side of) a graph
            assert figures["ms_per_step"] > 0 and figures["serial_ms"] > 0 and figures["text_ms"] > 0
        assert row["speedup"] == pytest.approx(row["baseline"]["ms_per_step"] / row["ms_per_step"], abs=0.01)

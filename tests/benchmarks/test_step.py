"""`pdserve bench step --json` splits prefill and decode steps into kinds of work whose
times add up to the step's."""

from __future__ import annotations

import json

import pytest

from pdserve.benchmarks import step


def test_step_report_splits_each_phase_by_kind(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    argv = ["--model", "bench-random-tiny", "--batch", "3", "--prompt-len", "20", "--decode-steps", "4", "--json"]
    assert step.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["batch"], report["prompt_len"]) == (3, 20)
    assert report["decode"]["steps"] == 4 and report["prefill"]["steps"] >= 1
    for phase in ("prefill", "decode"):
        r = report[phase]
        kinds = r["ms_per_step_by_kind"]
        assert set(kinds) == {*step.KINDS, "python and dispatch"}
        # Every kind of work ran, and the parts are the whole step.
        for kind in ("matmuls", "attention", "norms/rope/activation", "scheduling"):
            assert kinds[kind] > 0, (phase, kind)
        assert sum(kinds.values()) == pytest.approx(r["ms_per_step"], rel=0.02, abs=0.05)
        assert sum(r["share_by_kind"].values()) == pytest.approx(1.0, abs=0.01)
    assert report["decode"]["ms_per_step_by_kind"]["sampling"] > 0

"""`pdserve bench window --json` times the windowed decode kernel beside the masked SDPA
path it replaced and the whole-context kernel, for each context asked."""

from __future__ import annotations

import json

from pdserve.benchmarks import window


def test_a_quick_run_reports_each_context_with_both_baselines(capsys):
    argv = ["--batch", "2", "--contexts", "8,40", "--window", "16", "--heads", "4,2,32", "--repeats", "2", "--json"]
    assert window.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["context"] for r in report["rows"]] == [8, 40] and report["window"] == 16
    for r in report["rows"]:
        assert min(r["kernel_window_ms"], r["sdpa_window_mask_ms"], r["kernel_whole_context_ms"]) > 0
        assert r["sdpa_over_kernel"] > 0 and r["whole_over_window"] > 0

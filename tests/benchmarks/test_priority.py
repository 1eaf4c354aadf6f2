"""`pdserve bench priority`: its medians and ratios, and one smoke run of the whole bench on
a random tiny model (router + prefill + decode processes). What priority buys is measured
by the bench, not asserted here; the ordering itself is tested where each line is."""

from __future__ import annotations

import json

import pytest

from pdserve.benchmarks import priority as bench


def _burst(makespan, fg_ttft, bg_ttft, preemptions=0):
    return {"makespan_s": makespan, "foreground": [{"ttft_s": t, "done_s": t + 1} for t in fg_ttft],
            "background": [{"ttft_s": t, "done_s": t + 2} for t in bg_ttft], "preemptions": preemptions}


def test_summary_takes_each_class_median_per_mode_and_their_ratios():
    out = bench.summary({"fifo": [_burst(10, [8, 9], [1, 2, 3]), _burst(12, [7, 9], [1, 2, 5])],
                         "priority": [_burst(11, [1, 2], [3, 4, 5], 2), _burst(9, [2, 2], [4, 4, 6], 1)]})
    assert (out["fifo_foreground_ttft_s"], out["priority_foreground_ttft_s"]) == (8.5, 2)
    assert out["fifo_background_done_s"] == 4 and out["priority_background_ttft_s"] == 4
    assert out["foreground_ttft_ratio"] == pytest.approx(2 / 8.5)
    assert out["background_ttft_ratio"] == pytest.approx(4 / 2)
    assert out["makespan_ratio"] == pytest.approx(10 / 11)
    assert (out["fifo_decode_preemptions"], out["priority_decode_preemptions"]) == (0, 3)


def test_a_smoke_run_reports_both_modes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    out = tmp_path / "priority.json"
    # A decode pool of 2 requests, behind a router that lets 4 through: they wait in its line
    # for pages, where the foreground's priority preempts a running background request.
    assert bench.main(["--model", "bench-random-tiny", "--background", "3", "--foreground", "1", "--rounds", "1",
                       "--max-tokens", "2", "--prompt-words", "8", "--max-concurrent", "4", "--decode-pages", "6",
                       "--json", "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == json.loads(out.read_text())
    assert report["model"]["name"] == "bench-random-tiny" and report["max_concurrent"] == 4
    assert report["decode_pages"] == 6  # preemptions are as the timing falls: reported, not asserted
    assert all(report[f"{mode}_decode_preemptions"] >= 0 for mode in bench.MODES)
    for mode in bench.MODES:
        for kind in ("foreground", "background"):
            assert 0 < report[f"{mode}_{kind}_ttft_s"] <= report[f"{mode}_{kind}_done_s"]
    assert report["makespan_ratio"] > 0

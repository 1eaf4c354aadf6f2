"""`pdserve bench start` starts `serve` and `up` as a user would and reports how long each
took to print its ready line, `up`'s against `serve`'s."""

from __future__ import annotations

import json

from pdserve.benchmarks import start


def test_a_round_reports_both_ready_times_and_their_ratio(tiny_model, capsys):
    assert start.main(["--model", tiny_model, "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    [only] = report["rounds"]
    assert set(only) == {"serve", "up"} and all(s > 0 for s in only.values())
    assert (report["serve_ready_s"], report["up_ready_s"]) == (only["serve"], only["up"])
    assert report["up_over_serve"] == round(only["up"] / only["serve"], 3)


def test_no_rounds_is_refused_naming_the_flag(tiny_model, capsys):
    assert start.main(["--model", tiny_model, "--repeats", "0"]) == 2
    assert "--repeats must be at least 1, got 0" in capsys.readouterr().err

"""`pdserve bench trust --json`: a write through a per-request NIXL registration lands, a
cleared page holds nothing, and each cost comes as a ratio to the same run's KV write."""

from __future__ import annotations

import json

from pdserve.benchmarks import trust


def test_trust_costs_are_measured_against_the_write(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    argv = ["--model", "bench-random-tiny", "--tokens", "64", "--page-size", "4",
            "--pool-pages", "64", "--reps", "3", "--json"]
    assert trust.main(argv) == 0  # raises if a write did not land or a page was not cleared
    report = json.loads(capsys.readouterr().out)
    assert report["pages_per_request"] == 16 and report["reps"] == 3
    ms = report["median_ms"]
    assert set(ms) == {"write", "per_request_registration", "clear"}
    assert all(v > 0 for v in ms.values())
    for cost in ("clear", "per_request_registration"):
        ratio = ms[cost] / ms["write"]
        assert abs(report[f"{cost}_vs_write"] - ratio) <= 0.01 * ratio + 0.001


def test_every_transport_attack_is_printed_with_its_configuration_and_refused(tiny_model, capsys):
    assert trust.main(["--attacks", "transport", "--model", tiny_model, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["attacks"]
    assert len(rows) == 5
    for row in rows:
        assert row["refused"], row
        assert "--tls-cert" in row["configuration"] and row["outcome"]


def test_every_tenant_attack_is_printed_with_its_configuration_and_refused(tiny_model, capsys):
    """Bob against alice on one cluster: her request aborted by its id, her id squatted, the
    prefix cache probed for her secret, her flood against his short requests."""
    assert trust.main(["--attacks", "tenants", "--model", tiny_model, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["attacks"]
    assert [r["attack"].split()[1] for r in rows] == ["aborts", "takes", "probes", "queues"]
    for row in rows:
        assert row["refused"], row
        assert "--api-key-file" in row["configuration"] and row["outcome"]
    # the probe's control: with the operator's --shared-prefix-cache the right guess shows
    assert "--shared-prefix-cache" in rows[2]["outcome"]

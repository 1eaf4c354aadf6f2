"""`pdserve bench router --json` runs end to end and prints the three figures."""

from __future__ import annotations

import json

from pdserve.benchmarks.router import main


def test_bench_router_prints_overhead_and_rate(tiny_model, capsys):
    assert main(["--json", "--model", tiny_model, "--rounds", "20",
                 "--duration-s", "1", "--concurrency", "8"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["router_ttft_ms_p50"] > 0 and result["direct_ttft_ms_p50"] > 0
    assert result["overhead_ms_p99"] >= result["overhead_ms_p50"]
    assert result["requests_per_s"] > 0 and result["rate_errors"] == 0

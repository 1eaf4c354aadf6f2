"""benchmarks/gpu_cluster.py, quick sizes on the CPU: the code the GPU check runs (real
processes, gRPC and NIXL, `--device cpu`), every stage passing, every node stopped after."""

from __future__ import annotations

import json
import math

from pdserve.benchmarks.gpu_cluster import run


def test_quick_run_on_the_cpu_passes_every_stage_and_leaves_no_node(tmp_path):
    report = run("cpu", tmp_path / "work", tmp_path / "logs", quick=True)
    summary = {name: {k: v for k, v in stage.items() if k not in ("runs", "requests")}
               for name, stage in report["stages"].items()}
    assert report["ok"], json.dumps({"error": report.get("error"), **summary}, indent=1, default=str)

    exact = report["stages"]["exact"]
    assert exact["matches"] == exact["of"] == 6 and exact["remote"]
    assert exact["kv_bytes_sent"] == exact["kv_bytes_expected"] > 0
    assert exact["pool_devices"] == {"prefill": "cpu", "decode": "cpu"}
    ttft = report["stages"]["ttft"]
    assert set(ttft["by_setup"]) == {"page-major", "layer-major", "layer-major-16mib"}
    assert math.isfinite(ttft["transfer_added_fraction"])
    for one in ttft["by_setup"].values():
        assert one["ttft_s"] > 0 and one["prefill_alone_s"] > 0 and math.isfinite(one["transfer_added_fraction"])
        assert one["kv_descriptors"] >= one["kv_writes"] >= 1
        parts = one["breakdown"]  # every part found in the nodes' request logs
        assert parts["p_remote_send_s"] >= parts["p_prefill_s"] > 0 and parts["p_transfer_s"] >= 0
        assert parts["d_first_token_s"] > 0 and parts["d_alone_s"] > 0
        assert math.isfinite(parts["rest_s"]) and math.isfinite(parts["rest_alone_s"])
    faults = report["stages"]["faults"]
    assert faults["cancel"]["parked_while_frozen"] == 1
    assert faults["kill"]["route"]["skip_reason"] == "fallback" and faults["kill"]["matches"]
    assert json.loads((tmp_path / "logs" / "gpu_cluster.json").read_text())["ok"]

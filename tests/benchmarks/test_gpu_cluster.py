"""benchmarks/gpu_cluster.py, quick sizes on the CPU: the code the GPU check runs (real
processes, gRPC and NIXL, `--device cpu`), every stage passing, every node stopped after."""

from __future__ import annotations

import json
import math

import pytest

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
        legs = parts["legs"]  # every measured request's lines, joined by id across the nodes
        assert set(legs) == {"client_s", "to_prefill_s", "prefill_s", "relay_s", "first_token_s", "to_router_s"}
        assert legs["prefill_s"] > 0 and legs["first_token_s"] > 0 and legs["relay_s"] > 0
        assert set(parts["legs_alone"]) == {"client_s", "to_decode_s", "first_token_s", "to_router_s"}
    faults = report["stages"]["faults"]
    assert faults["cancel"]["parked_while_frozen"] == 1
    assert faults["kill"]["route"]["skip_reason"] == "fallback" and faults["kill"]["matches"]
    assert json.loads((tmp_path / "logs" / "gpu_cluster.json").read_text())["ok"]


def test_legs_join_each_request_across_the_nodes_by_id_and_add_up_to_its_ttft():
    from pdserve.benchmarks.gpu_cluster_stages import legs

    routed = [  # a warm-up first; "b" was prefilled by the decode node alone
        {"request_id": "w", "prompt_tokens": 8, "remote_send_skipped": False, "ts": 90.0, "e2e_s": 0.5, "ttft_s": 0.5},
        {"request_id": "a", "prompt_tokens": 8, "remote_send_skipped": False, "ts": 100.050, "e2e_s": 0.050,
         "ttft_s": 0.045},
        {"request_id": "b", "prompt_tokens": 8, "remote_send_skipped": True, "ts": 101.0, "e2e_s": 0.1, "ttft_s": 0.1}]
    sends = [{"request_id": "w", "ts": 89.9, "remote_send_s": 0.3},
             {"request_id": "a", "ts": 100.030, "remote_send_s": 0.028}]
    decodes = [{"request_id": "w", "ts": 90.0, "e2e_s": 0.05, "ttft_s": 0.05},
               {"request_id": "a", "ts": 100.046, "e2e_s": 0.013, "ttft_s": 0.010},
               {"request_id": "b", "ts": 101.0, "e2e_s": 0.099, "ttft_s": 0.098}]
    got = legs([{"request_id": "a", "ttft_s": 0.047}], routed, sends, decodes)
    want = {"client_s": 0.002, "to_prefill_s": 0.002, "prefill_s": 0.028, "relay_s": 0.003,
            "first_token_s": 0.010, "to_router_s": 0.002}
    assert got == pytest.approx(want, abs=1e-6) and sum(got.values()) == pytest.approx(0.047)
    assert legs([{"request_id": "b", "ttft_s": 0.1005}], routed, [], decodes) == pytest.approx(
        {"client_s": 0.0005, "to_decode_s": 0.001, "first_token_s": 0.098, "to_router_s": 0.001}, abs=1e-6)
    assert legs([{"request_id": "a", "ttft_s": 0.047}], routed, [], decodes) == {}  # its RemoteSend line missing
    assert legs([{"request_id": "gone", "ttft_s": 0.047}], routed, sends, decodes) == {}

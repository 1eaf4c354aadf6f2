"""The comparison's objectives and ratios, on hand-built results."""

import pytest

from pdserve.benchmarks.serve.compare import compare_rows, objectives, ratio
from pdserve.benchmarks.serve.metrics import RequestResult, summarize


def req(ttft: float, tpot: float, tokens: int = 3) -> RequestResult:
    times = [ttft + i * tpot for i in range(tokens)]
    return RequestResult(ok=True, prompt_len=8, output_tokens=tokens, start=0.0,
                         end=times[-1], token_times=times)


LIGHT = [req(0.1, 0.01), req(0.2, 0.02), req(0.3, 0.03)]


def test_objectives_are_multiples_of_the_light_load_median_and_p90():
    objs = objectives(LIGHT)
    assert objs["strict"] == pytest.approx({"ttft_ms": 3 * 200, "tpot_ms": 1.5 * 20})
    assert objs["loose"] == pytest.approx({"ttft_ms": 3 * 280, "tpot_ms": 1.5 * 28})


def test_objectives_need_a_baseline_with_tokens():
    with pytest.raises(RuntimeError, match="light-load baseline"):
        objectives([RequestResult(ok=False, error="UNAVAILABLE")])


def test_compare_rows_count_goodput_under_each_objective_and_divide_first_by_second():
    # Strict: TTFT <= 0.6 s, TPOT <= 0.03 s. Loose: TTFT <= 0.84 s, TPOT <= 0.042 s.
    colocated = [req(0.5, 0.04),   # loose only (TPOT over strict)
                 req(0.9, 0.01),   # neither (TTFT over loose)
                 req(0.2, 0.02)]   # both
    disagg = [req(0.7, 0.01),      # loose only (TTFT over strict)
              req(0.3, 0.02), req(0.3, 0.02)]  # both
    results = {"1p1d": [LIGHT, disagg], "colocated": [LIGHT, colocated]}
    rows = {name: [{**summarize(r, duration_s=10.0), "request_rate": rate}
                   for r, rate in zip(runs, (0.1, 0.5))] for name, runs in results.items()}
    table = compare_rows(rows, results, objectives(LIGHT))
    heavy = table[1]
    assert heavy["request_rate"] == 0.5
    assert heavy["1p1d"]["goodput_strict"] == pytest.approx(0.2)
    assert heavy["colocated"]["goodput_strict"] == pytest.approx(0.1)
    assert heavy["1p1d"]["goodput_loose"] == pytest.approx(0.3)
    assert heavy["colocated"]["goodput_loose"] == pytest.approx(0.2)
    assert heavy["goodput_ratio_strict"] == pytest.approx(2.0)
    assert heavy["goodput_ratio_loose"] == pytest.approx(1.5)
    # p90 TPOT: 1P1D [10, 20, 20] ms -> 20; colocated [10, 20, 40] ms -> 36.
    assert heavy["tpot_p90_ratio"] == pytest.approx(20 / 36)
    assert table[0]["goodput_ratio_strict"] == pytest.approx(1.0)


def test_with_the_peer_each_pdserve_system_is_divided_by_vllm():
    colocated = [req(0.2, 0.02), req(0.2, 0.02), req(0.9, 0.01)]  # strict: 2 of 3
    disagg = [req(0.3, 0.02)] * 3                                  # strict: 3 of 3
    peer = [req(0.2, 0.02), req(0.9, 0.05), req(0.9, 0.05)]        # strict: 1 of 3
    results = {"1p1d": [disagg], "colocated": [colocated], "vllm": [peer]}
    rows = {name: [{**summarize(r, duration_s=10.0), "request_rate": 0.5}]
            for name, (r,) in results.items()}
    (row,) = compare_rows(rows, results, objectives(LIGHT))
    assert row["vllm"]["goodput_strict"] == pytest.approx(0.1)
    assert row["vs_vllm"]["colocated"]["goodput_ratio_strict"] == pytest.approx(2.0)
    assert row["vs_vllm"]["1p1d"]["goodput_ratio_strict"] == pytest.approx(3.0)
    assert row["vs_vllm"]["1p1d"]["throughput_ratio"] == pytest.approx(1.0)


def test_a_ratio_over_nothing_is_null():
    assert ratio(1.0, 0.0) is None and ratio(None, 2.0) is None and ratio(1.0, 4.0) == 0.25


def test_headline_copies_the_ratios_of_the_named_rate_and_rejects_an_unswept_one():
    import pytest

    from pdserve.benchmarks.serve.compare import headline

    table = [{"request_rate": r, "tpot_p90_ratio": r / 10, "goodput_ratio_strict": r,
              "goodput_ratio_loose": 2 * r, "1p1d": {}, "colocated": {}} for r in (0.5, 1.0)]
    assert headline(table, 1.0) == {"request_rate": 1.0, "tpot_p90_ratio": 0.1,
                                    "goodput_ratio_strict": 1.0, "goodput_ratio_loose": 2.0}
    assert headline(table, None) is None
    with pytest.raises(SystemExit, match="0.7"):
        headline(table, 0.7)


def test_compare_records_the_model_name_directory_and_workers_dtype(tmp_path, monkeypatch,
                                                                    capsys):
    import json

    from pdserve.benchmarks.serve import compare
    from pdserve.benchmarks.serve.cli import main
    from pdserve.models.catalogue import CARD_FILE

    (tmp_path / CARD_FILE).write_text(json.dumps({"name": "smollm2-135m-instruct"}))
    served = []

    def run_system(name, args, model, cores, log_dir):
        served.append(model)
        rows = [{**summarize(LIGHT, duration_s=10.0), "request_rate": 0.5, "arrival": "poisson",
                 "max_concurrency": None}]
        return rows, [LIGHT]

    monkeypatch.setattr(compare, "run_system", run_system)
    assert main(["--compare", "--model", str(tmp_path), "--cores", "0,1", "--rates", "0.5",
                 "--node-args", "--dtype bfloat16", "--log-dir", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert served == [str(tmp_path)] * 2  # both systems serve the resolved directory
    assert out["model"] == {"name": "smollm2-135m-instruct", "dir": str(tmp_path),
                            "dtype": "bfloat16"}
    # Colocated is one node on both cores by default (vLLM's footprint), two on request.
    assert out["systems"]["colocated"].startswith("one role-both node on cores 0-1 with 2 threads")
    assert out["systems"]["1p1d"].startswith("prefill on core 0, decode on core 1") and out["cores"] == [[0], [1]]
    assert main(["--compare", "--model", str(tmp_path), "--cores", "0,1", "--rates", "0.5",
                 "--colocated-nodes", "2", "--log-dir", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["systems"]["colocated"].startswith("role both on core 0 and on core 1")
    # Core lists a side (for GPU workers): each node gets its side, colocated both.
    assert main(["--compare", "--model", str(tmp_path), "--cores", "0-1:2,3", "--rates", "0.5",
                 "--log-dir", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["systems"]["1p1d"].startswith("prefill on cores 0-1, decode on cores 2-3")
    assert out["systems"]["colocated"].startswith("one role-both node on cores 0-3 with 4 threads")
    assert out["cores"] == [[0, 1], [2, 3]]


@pytest.mark.parametrize("text, sides", [("0,1", ({0}, {1})), ("3,1", ({3}, {1})),
                                         ("0-3:4-7", ({0, 1, 2, 3}, {4, 5, 6, 7})),
                                         ("0,2:1", ({0, 2}, {1}))])
def test_cores_are_two_cores_or_two_core_lists(text, sides):
    from pdserve.benchmarks.serve.cli import parse_cores

    assert parse_cores(text) == sides


@pytest.mark.parametrize("text", ["0", "0,0", "0,1,2", "0-3:3-5", "a,b", "0-1:", ":1", "0:1:2"])
def test_cores_that_are_not_two_disjoint_sides_are_refused_with_the_forms(text):
    import argparse

    from pdserve.benchmarks.serve.cli import parse_cores

    with pytest.raises(argparse.ArgumentTypeError, match=r"A,B or two core lists.*LIST:LIST"):
        parse_cores(text)


def test_gpu_workers_get_half_the_cores_a_side_by_default(monkeypatch):
    from pdserve.benchmarks.serve.compare import default_cores

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(9)))
    monkeypatch.delenv("PDSERVE_DEVICE", raising=False)
    assert default_cores([]) == ({0}, {1})  # CPU workers: a core each, the fair share
    assert default_cores(["--device", "cuda:0"]) == ({0, 1, 2, 3}, {4, 5, 6, 7})
    monkeypatch.setenv("PDSERVE_DEVICE", "cuda")
    assert default_cores(["--dtype", "bfloat16"]) == ({0, 1, 2, 3}, {4, 5, 6, 7})


def test_fixed_objectives_give_each_system_goodput_and_the_ratio_over_vllm_pd():
    from pdserve.benchmarks.serve.metrics import Objectives

    fixed = Objectives(ttft_s=0.5, tpot_ms=30)
    colocated = [req(0.2, 0.02), req(0.2, 0.04), req(0.9, 0.01)]  # fixed: 1 of 3
    disagg = [req(0.3, 0.02)] * 3                                  # fixed: 3 of 3
    peer = [req(0.2, 0.02), req(0.2, 0.02), req(0.9, 0.05)]        # fixed: 2 of 3
    results = {"1p1d": [disagg], "colocated": [colocated], "vllm-pd": [peer]}
    rows = {name: [{**summarize(r, duration_s=10.0), "request_rate": 0.5,
                    **fixed.goodput(r, 10.0)}] for name, (r,) in results.items()}
    (row,) = compare_rows(rows, results, objectives(LIGHT))
    assert row["vllm-pd"]["goodput"] == pytest.approx(0.2)
    assert row["vllm-pd"]["goodput_fraction"] == pytest.approx(2 / 3)
    assert row["goodput_ratio_fixed"] == pytest.approx(3.0)       # 1p1d over colocated
    assert "vs_vllm" not in row
    assert row["vs_vllm_pd"]["1p1d"]["goodput_ratio_fixed"] == pytest.approx(1.5)
    assert row["vs_vllm_pd"]["colocated"]["goodput_ratio_fixed"] == pytest.approx(0.5)
    # p90 of the peer's TPOTs 20, 20, 50 ms: 20 + 0.8 * 30 = 44
    assert row["vs_vllm_pd"]["1p1d"]["tpot_p90_ratio"] == pytest.approx(20 / 44)


def test_compare_with_vllm_pd_records_the_fixed_objectives_and_the_peer(tmp_path, monkeypatch,
                                                                        capsys):
    import json

    from pdserve.benchmarks.serve import compare
    from pdserve.benchmarks.serve.cli import main

    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 100}))
    served = []

    def run_system(name, args, model, cores, log_dir):
        served.append(name)
        rows = [{**summarize(LIGHT, duration_s=10.0), "request_rate": 0.5, "arrival": "poisson",
                 "max_concurrency": None, **args.objectives.goodput(LIGHT, 10.0)}]
        return rows, [LIGHT]

    monkeypatch.setattr(compare, "run_system", run_system)
    monkeypatch.setattr("pdserve.benchmarks.peer.peer_python", lambda flag: tmp_path)
    assert main(["--compare", "--compare-peer", "vllm-pd", "--model", str(tmp_path),
                 "--cores", "0,1", "--rates", "0.5", "--log-dir", str(tmp_path), "--json",
                 "--slo-ttft-s", "0.25", "--slo-tpot-ms", "200"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert served == ["1p1d", "colocated", "vllm-pd"]
    assert out["objectives"]["fixed"] == {"ttft_s": 0.25, "tpot_ms": 200.0, "itl_p99_ms": None}
    assert "prefill server on core 0, decode server on core 1" in out["systems"]["vllm-pd"]
    (row,) = out["results"]
    assert row["vllm-pd"]["good_requests"] == 2  # LIGHT's TTFTs: 0.1, 0.2, 0.3
    assert row["vs_vllm_pd"]["1p1d"]["goodput_ratio_fixed"] == pytest.approx(1.0)


@pytest.mark.parametrize("argv, message", [
    (["--compare-peer", "vllm-pd"], "--compare-peer vllm-pd needs --compare"),
    (["--slo-tpot-ms", "-5"], "tpot_ms must be a positive number, got -5"),
    (["--slo-ttft-s", "1", "--ttft-slo-ms", "900"], "--slo-ttft-s or --ttft-slo-ms, not both"),
])
def test_the_cli_rejects_bad_peer_and_objective_flags_before_starting_anything(argv, message):
    from pdserve.benchmarks.serve.cli import main

    with pytest.raises(SystemExit, match=message):
        main(argv)


def test_the_cli_offers_both_peers_and_reads_the_older_objective_spellings():
    from pdserve.benchmarks.serve.cli import build_parser
    from pdserve.benchmarks.serve.runs import fixed_objectives

    parser = build_parser()
    assert parser.parse_args(["--compare-peer", "vllm-pd"]).compare_peer == "vllm-pd"
    with pytest.raises(SystemExit):
        parser.parse_args(["--compare-peer", "sglang"])
    args = parser.parse_args(["--ttft-slo-ms", "1500", "--slo-itl-p99-ms", "1000"])
    assert fixed_objectives(args).ttft_s == pytest.approx(1.5)
    assert fixed_objectives(args).itl_p99_ms == 1000


@pytest.mark.parametrize("system, nodes, expected", [
    ("1p1d", 1, [("prefill", {0, 1}, 2), ("decode", {2, 3}, 2), ("router", {0, 1, 2, 3}, 4)]),
    ("colocated", 1, [("serve", {0, 1, 2, 3}, 4), ("router", {0, 1, 2, 3}, 4)]),
    ("colocated", 2, [("serve", {0, 1}, 2), ("serve", {2, 3}, 2), ("router", {0, 1, 2, 3}, 4)])])
def test_each_node_is_pinned_to_its_side_with_a_thread_per_core(tmp_path, monkeypatch, system, nodes,
                                                                expected):
    """Which cores each process gets (the processes themselves are stood in for)."""
    from pdserve.benchmarks.serve import cluster

    started = []

    class Node:
        def __init__(self, args, log, cores, threads):
            started.append((args[0], cores, threads))
            assert args[0] == "router" or args[args.index("--num-threads") + 1] == str(threads)

        def wait_ready(self, timeout_s):
            return "127.0.0.1:1"

    monkeypatch.setattr(cluster, "NodeProcess", Node)
    monkeypatch.setattr(cluster, "stop_all", lambda procs: None)
    with cluster.start_cluster(system, "m", (frozenset({0, 1}), frozenset({2, 3})), tmp_path,
                               colocated_nodes=nodes):
        pass
    assert started == expected

"""`pdserve bench serve` end to end against the real tiny 1P1D cluster."""

import json

from pdserve.benchmarks.serve.cli import main
from pdserve.benchmarks.serve.workload import synthetic

VOCAB_SIZE = 512  # the tiny checkpoint's (tests/conftest.py)
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "server_ttft_ms")


def test_bench_serve_sweeps_two_rates_and_reports_every_metric(cluster, tmp_path, capsys):
    out_file, plot_file = tmp_path / "results.json", tmp_path / "sweep.png"
    code = main(["--server", cluster.address("router"), "--num-prompts", "4",
                 "--input-len", "16:64", "--output-len", "4:8", "--rates", "8,inf",
                 "--ttft-slo-ms", "60000", "--tpot-slo-ms", "60000", "--seed", "7",
                 "--json", "--output", str(out_file), "--plot", str(plot_file)])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out_file.read_text())
    assert plot_file.stat().st_size > 10_000
    assert printed["backend"] == "grpc" and printed["target"] == cluster.address("router")
    assert printed["workload"]["input_len"] == [16, 64]
    runs = printed["runs"]
    assert [r["request_rate"] for r in runs] == [8.0, None]  # None: unbounded
    for i, run in enumerate(runs):
        # Each rate gets its own prompts; every output is exactly as long as asked.
        asked = synthetic(4, (16, 64), (4, 8), VOCAB_SIZE, seed=f"7-{i}")
        assert (run["completed"], run["failed"]) == (4, 0), run["errors"]
        assert run["output_tokens"] == sum(r.output_len for r in asked)
        assert run["input_tokens"] == sum(r.prompt_len for r in asked)
        for key in LATENCIES:
            assert set(run[key]) == {"mean", "median", "p90", "p99"}
            assert run[key]["median"] > 0
        assert run["ttft_ms"]["median"] <= run["e2e_ms"]["median"]
        assert run["request_throughput"] > 0 and run["output_throughput"] > 0
        # Objectives of a minute: every request is good.
        assert run["goodput"] == run["request_throughput"]


def test_bench_serve_replays_sharegpt_at_fixed_concurrency(cluster, tiny_model, tmp_path,
                                                           capsys):
    from pdserve.router.tokenizer import PromptTokenizer

    conversations = [{"conversations": [
        {"from": "human", "value": f"the quick brown fox {i} jumps over the lazy dog " * (i + 1)},
        {"from": "gpt", "value": "a river city light shadow window garden music " * (i + 1)}]}
        for i in range(3)]
    dataset, out_file = tmp_path / "sharegpt.json", tmp_path / "results.json"
    dataset.write_text(json.dumps(conversations))
    code = main(["--server", cluster.address("router"), "--dataset", str(dataset),
                 "--num-prompts", "2", "--max-concurrency", "1", "--warmup", "0",
                 "--output", str(out_file)])
    assert code == 0
    assert "TTFT ms" in capsys.readouterr().out  # the table, not JSON
    run = json.loads(out_file.read_text())["runs"][0]
    assert (run["completed"], run["max_concurrency"], run["request_rate"]) == (2, 1, None)
    # Output lengths come from the answers, counted with the model's own tokenizer,
    # which the bench found through the server's GetModelInfo.
    tokenizer = PromptTokenizer(tiny_model)
    answers = [len(tokenizer.encode(c["conversations"][1]["value"])) for c in conversations]
    assert run["output_tokens"] in {answers[i] + answers[j] for i in range(3) for j in range(i)}

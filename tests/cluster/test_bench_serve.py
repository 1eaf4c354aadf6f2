"""`pdserve bench serve` end to end against the real tiny 1P1D cluster: what it measures,
what it shows while it runs and after each run, and the OpenAI backend without
--vocab-size (the vocabulary comes from the tokenizer of the model the server names)."""

import json
import re

import pytest

from pdserve.benchmarks.serve.backends import ModelLimits
from pdserve.benchmarks.serve.cli import build_parser, main
from pdserve.benchmarks.serve.runs import make_workload
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
    out, err = capsys.readouterr()
    printed = json.loads(out)  # stdout is the JSON alone
    assert printed == json.loads(out_file.read_text())
    # While it ran (stderr is no terminal here): plain progress lines, then each run's block.
    assert "bench serve @ 8 req/s: 4/4 done, 0 failed" in err
    assert "bench serve @ inf req/s: 4/4 done, 0 failed" in err
    assert err.count("Serving Benchmark Result") == 2
    assert f"{'Successful requests:':<40} 4" in err.splitlines()
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
    shown = capsys.readouterr().out.splitlines()  # the run's summary block, not JSON
    assert shown[0] == "============ Serving Benchmark Result ============"
    assert f"{'Successful requests:':<40} 2" in shown and f"{'Failed requests:':<40} 0" in shown
    assert any(line.startswith("Median TTFT (ms):") for line in shown)
    assert not any("TTFT ms" in line for line in shown)  # one run: no table of runs
    run = json.loads(out_file.read_text())["runs"][0]
    assert (run["completed"], run["max_concurrency"], run["request_rate"]) == (2, 1, None)
    # Output lengths come from the answers, counted with the model's own tokenizer,
    # which the bench found through the server's GetModelInfo.
    tokenizer = PromptTokenizer(tiny_model)
    answers = [len(tokenizer.encode(c["conversations"][1]["value"])) for c in conversations]
    assert run["output_tokens"] in {answers[i] + answers[j] for i in range(3) for j in range(i)}


def test_the_openai_backend_reads_the_vocabulary_from_the_tokenizer_of_the_served_model(
        cluster, tmp_path):
    # The router's OpenAI API names its model by the checkpoint directory, whose tokenizer
    # has the 512 ids of the tiny model: synthetic prompts are drawn below 512.
    args = build_parser().parse_args(["--backend", "openai", "--url", cluster.http,
                                      "--num-prompts", "8", "--input-len", "64:128"])
    workload = make_workload(args, ModelLimits(model=cluster.model))
    assert workload(0) == synthetic(8, (64, 128), (64, 128), VOCAB_SIZE, seed="0-0")
    args.tokenizer = str(tmp_path)  # a directory with no tokenizer in it
    with pytest.raises(SystemExit, match=re.escape("--tokenizer DIR|MODEL_ID or --vocab-size")):
        make_workload(args, ModelLimits(model=cluster.model))

    out_file = tmp_path / "results.json"
    code = main(["--backend", "openai", "--url", cluster.http, "--num-prompts", "3",
                 "--input-len", "8:16", "--output-len", "2:4", "--warmup", "0",
                 "--output", str(out_file)])
    assert code == 0
    result = json.loads(out_file.read_text())
    assert result["model"] == cluster.model
    assert (result["runs"][0]["completed"], result["runs"][0]["failed"]) == (3, 0)

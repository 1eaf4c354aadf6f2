"""`pdserve bench engine --quick --json` runs both engines and reports every figure; with
`--peer vllm` the job and result that cross to the peer's child process."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from pdserve.benchmarks import engine as bench
from pdserve.benchmarks import peer as peers


def test_quick_bench_reports_both_throughputs_and_speedup(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    assert bench.main(["--quick", "--json", "--model", "bench-random-tiny"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"model", "dtype", "threads", "quick", "workloads"} <= report.keys()
    assert report["dtype"] == "float32" and report["quick"] is True
    # The model measured: its name, the directory both engines loaded (written into the
    # cache on first use) and the dtype they ran in.
    model = report["model"]
    assert (model["name"], model["dtype"]) == ("bench-random-tiny", "float32")
    assert Path(model["dir"]).parent == tmp_path and Path(model["dir"], "config.json").exists()
    assert model["vocab_size"] == 1024 and model["parameters"] > 0
    assert [w["workload"] for w in report["workloads"]] == ["mixed", "uniform"]
    for w in report["workloads"]:
        for key in ("num_prompts", "prompt_tokens", "generated_tokens", "engine_s", "transformers_s",
                    "engine_tokens_per_s", "transformers_tokens_per_s", "speedup", "greedy_match"):
            assert key in w, key
        assert w["engine_tokens_per_s"] > 0 and w["transformers_tokens_per_s"] > 0
        assert not any(key.startswith("peer") for key in w)
        ratio = w["engine_tokens_per_s"] / w["transformers_tokens_per_s"]
        assert w["speedup"] == pytest.approx(ratio, rel=0.01)
        # fp32 greedy on a tiny model: both engines pick the same tokens.
        assert w["greedy_match"] == 1.0


def test_prefill_only_keeps_the_prompts_and_asks_one_token_of_each(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    argv = ["--quick", "--json", "--model", "bench-random-tiny", "--workload", "long-mixed", "--prefill-only"]
    assert bench.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["prefill_only"] is True
    (w,) = report["workloads"]
    (full,) = bench.make_workloads(["long-mixed"], 1024, quick=True)
    assert w["workload"] == "long-mixed-prefill"
    assert w["prompt_tokens"] == sum(map(len, full.prompts))
    assert w["generated_tokens"] == w["num_prompts"] == len(full.prompts)
    assert w["greedy_match"] == 1.0
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps cells to the terminal's width
    bench.print_table(report)
    assert "long-mixed-prefill" in capsys.readouterr().out


def test_step_batches_time_full_decode_steps_beside_the_bytes_they_read(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    argv = ["--quick", "--json", "--model", "bench-random-tiny", "--workload", "uniform", "--step-batches", "1,3"]
    assert bench.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device"] == "cpu" and report["datasheet_bytes_per_s"] is None
    one, three = report["decode_steps"]
    assert (one["batch"], three["batch"]) == (1, 3)
    # every timed step ran the whole batch, and three contexts read more KV than one
    assert one["all_steps_full"] and three["all_steps_full"]
    assert three["bytes_read_per_step"] > one["bytes_read_per_step"] > 0
    assert one["median_ms"] > 0 and one["limit_ms_datasheet"] is None


def test_workloads_fit_the_real_models_vocabulary_and_context():
    for quick in (False, True):
        for w in bench.make_workloads(["mixed", "uniform"], 49152, quick):
            assert all(bench.FIRST_PROMPT_TOKEN <= t < 49152 for p in w.prompts for t in p)
            assert max(len(p) + n for p, n in zip(w.prompts, w.output_lens)) <= 8192


def test_the_kv_cache_holds_every_context_of_the_largest_workload_at_once():
    from types import SimpleNamespace

    smollm2 = SimpleNamespace(num_hidden_layers=30, num_key_value_heads=3, head_dim=64,
                              hidden_size=576, num_attention_heads=9)
    workloads = bench.make_workloads(["mixed", "uniform"], 49152, quick=False)
    tokens = sum(len(p) + n for p, n in zip(workloads[0].prompts, workloads[0].output_lens))
    fp32 = bench.kv_cache_bytes(smollm2, "float32", workloads, page_size=16)
    assert fp32 >= tokens * 2 * 30 * 3 * 64 * 4
    assert bench.kv_cache_bytes(smollm2, "bfloat16", workloads, page_size=16) == fp32 // 2


def test_the_peer_workloads_have_their_shapes():
    long_mixed, decode_heavy = bench.make_workloads(["long-mixed", "decode-heavy"], 49152, quick=False)
    assert len(long_mixed.prompts) == 32
    assert all(32 <= len(p) <= 1024 for p in long_mixed.prompts)
    assert all(16 <= n <= 256 for n in long_mixed.output_lens)
    assert len(decode_heavy.prompts) == 64
    assert {len(p) for p in decode_heavy.prompts} == {64} and set(decode_heavy.output_lens) == {512}
    for w in bench.make_workloads(list(bench.WORKLOADS), 49152, quick=True):
        # Smoke-test sized, and within bench-random-tiny's 512 positions and 1024 ids.
        assert len(w.prompts) <= 8 and max(len(p) + n for p, n in zip(w.prompts, w.output_lens)) <= 128
    for w in bench.make_workloads(list(bench.WORKLOADS), 1024, quick=True):
        assert all(bench.FIRST_PROMPT_TOKEN <= t < 1024 for p in w.prompts for t in p)


def test_all_means_the_transformers_pair_unless_a_peer_is_chosen():
    assert bench.workload_names("all", peer=None) == ["mixed", "uniform"]
    assert bench.workload_names("all", peer="vllm") == ["uniform", "long-mixed", "decode-heavy"]
    assert bench.workload_names("decode-heavy", peer="vllm") == ["decode-heavy"]
    assert bench.workload_names("mixed", peer=None) == ["mixed"]


def quick_job():
    workloads = bench.make_workloads(["uniform", "long-mixed"], 49152, quick=True)
    warmup = bench.Workload("warmup", [[bench.FIRST_PROMPT_TOKEN] * 8] * 2, [2, 2], 2)
    return workloads, peers.build_job("/models/m", "bfloat16", workloads, warmup)


def test_the_peer_job_carries_every_prompt_and_length_through_json():
    workloads, job = quick_job()
    job = json.loads(json.dumps(job))
    assert (job["model"], job["dtype"]) == ("/models/m", "bfloat16")
    assert job["warmup"]["output_lens"] == [2, 2]
    assert [w["name"] for w in job["workloads"]] == ["uniform", "long-mixed"]
    for sent, w in zip(job["workloads"], workloads):
        assert sent["prompts"] == w.prompts and sent["output_lens"] == w.output_lens
    assert job["max_model_len"] == max(len(p) + n for w in workloads
                                       for p, n in zip(w.prompts, w.output_lens))


def fabricated_result(job, lens=None):
    return {"peer": "vllm", "version": "0.0-test", "startup_s": 12.5, "workloads": [
        {"name": w["name"], "seconds": 0.5 + i,
         "token_ids": [[7] * n for n in (lens or w["output_lens"])]}
        for i, w in enumerate(job["workloads"])]}


def test_the_peer_result_is_read_back_workload_by_workload():
    _, job = quick_job()
    result = peers.parse_result(json.loads(json.dumps(fabricated_result(job))), job)
    assert (result.peer, result.version, result.startup_s) == ("vllm", "0.0-test", 12.5)
    assert [w.name for w in result.workloads] == ["uniform", "long-mixed"]
    assert [w.seconds for w in result.workloads] == [0.5, 1.5]
    assert [len(t) for t in result.workloads[1].token_ids] == job["workloads"][1]["output_lens"]


def test_a_peer_result_that_does_not_answer_its_job_is_refused():
    _, job = quick_job()
    short = fabricated_result(job)
    short["workloads"][0]["token_ids"][0] = [7]
    with pytest.raises(peers.PeerFailed, match=r"uniform: the peer generated \[1, 8, 8, 8\] tokens"):
        peers.parse_result(short, job)
    reordered = fabricated_result(job)
    reordered["workloads"].reverse()
    with pytest.raises(peers.PeerFailed, match="asked \\['uniform', 'long-mixed'\\]"):
        peers.parse_result(reordered, job)


def test_the_peer_child_gets_the_cores_a_big_enough_kv_cache_and_no_network():
    # Twice pdserve's bytes (vLLM's CPU cache holds about half as many tokens), whole GiB.
    env = peers.peer_env(kv_cache_bytes=3 * peers.GiB // 4, python=Path("/no/venv/bin/python"))
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == peers.cpu_list(sorted(os.sched_getaffinity(0)))
    assert peers.cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert "LD_PRELOAD" not in env


def test_the_peer_venvs_intel_openmp_is_preloaded_when_it_has_one(tmp_path, monkeypatch):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    monkeypatch.setenv("LD_PRELOAD", "/already/there.so")
    env = peers.peer_env(kv_cache_bytes=1, python=tmp_path / "bin" / "python")
    assert env["LD_PRELOAD"] == f"{tmp_path / 'lib' / 'libiomp5.so'}:/already/there.so"


def test_a_missing_peer_interpreter_names_its_path_and_the_make_target(tmp_path, monkeypatch, capsys):
    absent = tmp_path / "nowhere" / "python"
    argv = ["--peer", "vllm", "--quick", "--json", "--model", "bench-random-tiny"]
    assert bench.main([*argv, "--peer-python", str(absent)]) == 2
    err = capsys.readouterr().err
    assert str(absent) in err and "make bench-peers" in err

    monkeypatch.setenv(peers.PEER_PYTHON_ENV, str(tmp_path / "from-env"))
    assert bench.main(argv) == 2
    assert str(tmp_path / "from-env") in capsys.readouterr().err

    monkeypatch.delenv(peers.PEER_PYTHON_ENV)
    monkeypatch.setattr(peers, "REPO_ROOT", tmp_path)
    assert bench.main(argv) == 2
    assert str(tmp_path / ".venv-peers/vllm/bin/python") in capsys.readouterr().err


def test_a_relative_peer_interpreter_is_found_from_where_the_bench_started(tmp_path, monkeypatch):
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").write_text("")
    monkeypatch.chdir(tmp_path)
    assert peers.peer_python("venv/bin/python") == tmp_path / "venv" / "bin" / "python"


# A stand-in for vLLM's API, strict about what the benchmark must ask of it, so the child
# script and both sides of the job run without vLLM installed.
FAKE_VLLM = '''
import os
import time
__version__ = "0.0-fake"

class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos):
        assert temperature == 0 and ignore_eos is True
        self.max_tokens = max_tokens

class LLM:
    def __init__(self, model, dtype, enable_prefix_caching, max_model_len, seed):
        assert os.path.isdir(model) and dtype == "float32" and enable_prefix_caching is False
        assert int(os.environ["VLLM_CPU_KVCACHE_SPACE"]) >= 1 and os.environ["HF_HUB_OFFLINE"] == "1"
        self.max_model_len = max_model_len

    def generate(self, prompts, params, use_tqdm):
        class Sample:
            def __init__(self, ids): self.token_ids = ids
        class Output:
            def __init__(self, ids): self.outputs = [Sample(ids)]
        out = []
        for prompt, p in zip(prompts, params):
            assert len(prompt["prompt_token_ids"]) + p.max_tokens <= self.max_model_len
            out.append(Output([prompt["prompt_token_ids"][0]] * p.max_tokens))
        # The stand-in engine's own generation time, 2 ms a token: the harness measures this
        # duration, so it is what the ratio below is made of (not a wait for anything).
        time.sleep(0.002 * sum(p.max_tokens for p in params))
        return out
'''


def test_quick_bench_against_a_peer_reports_both_engines_and_their_ratio(tmp_path, monkeypatch, capsys):
    fake = tmp_path / "fake" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(FAKE_VLLM)
    (fake / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n"
                                    "    return {'prompt_token_ids': prompt_token_ids}\n")
    monkeypatch.setenv("PYTHONPATH", str(fake.parent))
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    argv = ["--quick", "--json", "--model", "bench-random-tiny",
            "--peer", "vllm", "--peer-python", sys.executable]
    assert bench.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["peer"]["version"] == "0.0-fake" and report["peer"]["startup_s"] >= 0
    assert report["engine_startup_s"] > 0
    assert [w["workload"] for w in report["workloads"]] == ["uniform", "long-mixed", "decode-heavy"]
    for w in report["workloads"]:
        assert "transformers_s" not in w and "greedy_match" not in w
        assert w["engine_tokens_per_s"] > 0 and w["peer_tokens_per_s"] > 0
        ratio = w["engine_tokens_per_s"] / w["peer_tokens_per_s"]
        assert w["peer_ratio"] == pytest.approx(ratio, rel=0.01)
        assert 0.0 <= w["peer_match"] <= 1.0


def test_tensor_parallel_runs_tp1_then_tp2_on_the_same_workloads_with_their_ratios(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    argv = ["--quick", "--json", "--model", "bench-random-tiny", "--tensor-parallel-size", "2", "--step-batches", "1"]
    assert bench.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    cores = len(os.sched_getaffinity(0))
    assert (report["tensor_parallel_size"], report["cores"]) == (2, cores)
    base, tp = report["runs"]
    # both runs fill the machine: one rank on every core, two ranks on half each
    assert (base["tensor_parallel_size"], base["threads_per_rank"]) == (1, cores)
    assert (tp["tensor_parallel_size"], tp["threads_per_rank"]) == (2, max(1, cores // 2))
    assert [w["workload"] for w in report["workloads"]] == ["mixed", "uniform"]
    for w in report["workloads"]:
        assert "transformers_s" not in w
        assert w["baseline_tokens_per_s"] > 0 and w["tp_tokens_per_s"] > 0
        assert w["tp_ratio"] == pytest.approx(w["tp_tokens_per_s"] / w["baseline_tokens_per_s"], rel=0.01)
        # fp32 greedy on a tiny model: splitting it does not change a token
        assert w["greedy_match"] == 1.0
    (step,) = report["decode_steps"]
    assert step["batch"] == 1 and step["baseline_median_ms"] > 0
    assert step["tp_ratio"] == pytest.approx(step["tp_median_ms"] / step["baseline_median_ms"], rel=0.01)
    monkeypatch.setenv("COLUMNS", "200")
    from pdserve.benchmarks.engine_table import print_tp_table

    print_tp_table(report)
    out = capsys.readouterr().out
    assert "TP = 2 vs TP = 1" in out and f"2 ranks x {max(1, cores // 2)} threads" in out


def test_tensor_parallel_compares_pdserve_with_itself_only(tmp_path, monkeypatch, capsys):
    from pdserve.benchmarks.engine_tp import thread_counts

    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    argv = ["--quick", "--json", "--model", "bench-random-tiny", "--tensor-parallel-size", "2", "--transformers"]
    assert bench.main(argv) == 2
    assert "drop --peer, --transformers and --device" in capsys.readouterr().err
    assert thread_counts(2, 2) == [(1, 2), (2, 1)]
    assert thread_counts(16, 4) == [(1, 16), (4, 4)]
    assert thread_counts(1, 2) == [(1, 1), (2, 1)]  # never zero threads

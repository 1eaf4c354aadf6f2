"""The GPU step path (`ModelRunner._run_gpu`: one pinned copy of the step's indices, no
host read of device values, logits left on the device; `DecodeGraphs`: static buffers,
bucketed batch sizes, padding rows) generates transformers' greedy tokens. Run here on
the CPU through Triton's interpreter, with the graphs' forward replayed eagerly over the
same buffers; `benchmarks/gpu.py` runs the real thing on a GPU."""

from __future__ import annotations

import os

import pytest
import torch

# Triton picks the interpreter when it is imported, for the whole process: on a host with
# CUDA, these interpreter tests would turn the GPU tests of the same session into
# interpreted ones. tests/engine/test_gpu_kernels.py runs the kernels compiled there.
if torch.cuda.is_available():
    pytest.skip("Triton interpreter tests; with CUDA, test_gpu_kernels.py runs the kernels compiled",
                allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported, and so before anything jits

from pdserve.engine import LLM, SamplingParams  # noqa: E402
from pdserve.engine.model.decode_graphs import DecodeGraphs, bucket_sizes  # noqa: E402
from pdserve.engine.model.fused import TorchOps  # noqa: E402


def gpu_path_llm(model_dir, max_num_seqs: int, **kwargs) -> LLM:
    """An engine on the CPU that takes the GPU's step path, graphs run eagerly."""
    llm = LLM(model_dir, attention_backend="triton", max_num_seqs=max_num_seqs, **kwargs)
    engine = llm.engine
    runner = engine.runner
    m = runner.model
    # On a GPU the layer's small ops are torch's or Triton's, whose KV store skips the
    # padding rows' slot -1; the CPU's C kernels take no padding.
    m.ops = TorchOps(m.rope, m.num_heads, m.num_kv_heads, m.head_dim, m.eps)
    runner.on_gpu = True
    engine.overlap_output = True  # as on a GPU
    runner.graphs = None if m.moe else DecodeGraphs(runner.model, runner.kv_cache, runner.page_size, max_num_seqs,
                                                    engine.max_model_len, capture=False)
    return llm


def test_bucket_sizes_cover_every_batch_up_to_the_largest():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]


@pytest.mark.parametrize("family, kv_layout", [("llama", "page-major"), ("qwen3", "page-major"),
                                               ("llama", "layer-major"), ("qwen2_moe", "page-major"),
                                               ("gemma", "page-major"), ("olmo2", "page-major"),
                                               ("ministral3", "page-major"), ("apertus", "page-major"),
                                               ("glm4", "page-major"), ("gpt_oss", "page-major"),
                                               ("hunyuan_v1_dense", "page-major"), ("llama4", "page-major")])
def test_gpu_step_path_generates_transformers_greedy_tokens(checkpoint_dirs, hf_greedy, family, kv_layout):
    model = checkpoint_dirs(family)
    # 3 sequences run the graph of 4 (one padding row); page size 3 and a 16-token budget
    # chunk the prefills, so mixed steps, kept rows and cached prefixes all occur.
    llm = gpu_path_llm(model, max_num_seqs=6, page_size=3, max_num_batched_tokens=16, kv_layout=kv_layout)
    prompts = [[5, 6, 7, 8, 9] * 4, [10, 11, 12], [13, 40, 7] * 9]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(family, tuple(prompt), 6), prompt
    engine = llm.engine
    assert engine.num_free_pages() == engine.num_total_pages()


def test_gpu_step_path_runs_lora_rows_eagerly_beside_graphed_base_steps(checkpoint_dirs, tmp_path):
    from pdserve.engine.checkpoint import write_lora_adapter
    from tests.engine.test_lora import peft_greedy, run_all

    model = checkpoint_dirs("llama")
    adapter = write_lora_adapter(model, tmp_path / "a", seed=1)
    llm = gpu_path_llm(model, max_num_seqs=4, page_size=3, max_num_batched_tokens=16, lora_modules=[f"a={adapter}"])
    graphs, replays = llm.engine.runner.graphs, []
    run = graphs.run
    graphs.run = lambda seqs: replays.append([s.request.lora for s in seqs]) or run(seqs)
    # The base prompt's first token comes a step after the adapter's, so its last decode
    # runs alone and replays the graph; the steps with the adapter's rows run eagerly.
    requests = [([10, 11, 12], "a"), ([5, 6, 7, 8, 9] * 4, "")]
    outs = run_all(llm.engine, requests)
    for (prompt, lora), out in zip(requests, outs):
        assert out == peft_greedy(model, adapter if lora else None, prompt)
    assert replays and all(row == -1 for rows in replays for row in rows)


def test_gpu_step_path_scores_a_prompt_as_transformers_does(checkpoint_dirs, hf_greedy, hf_logprobs):
    model = checkpoint_dirs("llama")
    # A 16-token budget cuts the 20-token prompt in two; the other request shares the steps.
    llm = gpu_path_llm(model, max_num_seqs=4, page_size=3, max_num_batched_tokens=16)
    prompts = [[5, 6, 7, 8, 9] * 4, [10, 11, 12]]
    plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    scored = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate(prompts, [scored, plain])
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy("llama", tuple(prompt), 4)
    want = hf_logprobs("llama", prompts[0])
    got = outs[0].prompt_logprobs
    assert [s.token_id for s in got] == prompts[0][1:] and outs[1].prompt_logprobs is None
    torch.testing.assert_close(torch.tensor([s.logprob for s in got]),
                               want.gather(1, torch.tensor(prompts[0][1:]).unsqueeze(1)).squeeze(1),
                               atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor([[v for _, v in s.top_logprobs] for s in got]),
                               want.topk(2, dim=-1).values, atol=1e-4, rtol=0)


def test_gpu_step_path_applies_penalties_as_transformers_does(checkpoint_dirs, hf_penalized):
    # Penalised and plain rows share the graph's steps; the penalties' tallies and the
    # logits stay on the device (pinned copies in, nothing read back).
    llm = gpu_path_llm(checkpoint_dirs("llama"), max_num_seqs=4, page_size=3, max_num_batched_tokens=16)
    prompts = [[5, 6, 7, 8, 9] * 4, [10, 11, 12], [13, 40, 7] * 5]
    penalized = SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5,
                               presence_penalty=0.5, logit_bias={40: 3.0})
    plain = SamplingParams(max_tokens=8, temperature=0.0)
    outs = llm.generate(prompts, [penalized, plain, penalized])
    for prompt, out, params in zip(prompts, outs, [penalized, plain, penalized]):
        assert out.outputs[0].token_ids == hf_penalized(prompt, params), prompt


def test_gpu_step_path_holds_each_answer_to_its_structure(checkpoint_dirs):
    import re

    from pdserve.sampling import StructuredOutput

    # The text of a step's tokens is made during the next step (overlapped output); each
    # token reaches its grammar when it is sampled, before the next step's mask.
    llm = gpu_path_llm(checkpoint_dirs("llama"), max_num_seqs=4, page_size=3, max_num_batched_tokens=16)
    prompts = [[5, 6, 7, 8, 9] * 4, [10, 11, 12], [13, 40, 7] * 5]
    shaped = SamplingParams(max_tokens=10, temperature=0.0, structured_output=StructuredOutput("regex", "[a-c]{3}[0-9]"))
    sampled = SamplingParams(max_tokens=10, temperature=1.0, seed=1, structured_output=StructuredOutput(
        "choice", ("alpha", "beta")))
    outs = llm.generate(prompts, [shaped, SamplingParams(max_tokens=10, temperature=0.0), sampled])
    assert re.fullmatch("[a-c]{3}[0-9]", outs[0].outputs[0].text) and outs[0].outputs[0].finish_reason == "stop"
    assert outs[2].outputs[0].text in ("alpha", "beta")


def test_decodes_split_over_their_contexts_generate_transformers_greedy_tokens(checkpoint_dirs, hf_greedy,
                                                                               monkeypatch):
    from pdserve.engine.attention import triton_ops

    # As on a GPU with SMs to spare: each decode's context in three splits, combined. The
    # long prompt's splits are a tile (64 positions) each, the last one partial; the short
    # ones leave splits empty. Prefills' kept rows are decodes' shape and split too.
    monkeypatch.setattr(triton_ops, "decode_splits", lambda num_seqs, num_kv_heads, device: 3)
    model = checkpoint_dirs("llama")
    llm = gpu_path_llm(model, max_num_seqs=4, page_size=16)
    prompts = [[(7 * i) % 90 + 3 for i in range(150)], [10, 11, 12]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        assert out.outputs[0].token_ids == hf_greedy("llama", tuple(prompt), 6), len(prompt)


def test_graph_buffers_pad_rows_that_store_nothing(checkpoint_dirs):
    llm = gpu_path_llm(checkpoint_dirs("llama"), max_num_seqs=8, page_size=4, num_pages=64)
    engine = llm.engine
    before = engine.kv_cache.clone()
    graphs = engine.runner.graphs
    # One real sequence of 5 tokens at position 4 in a bucket of 1, then the same in a
    # bucket of 2 (its second row padding): the padding row writes no KV anywhere.
    engine.add_request("r", [5, 6, 7, 8, 9], SamplingParams(max_tokens=2, temperature=0.0))
    engine.step()  # the prefill
    seq = engine.requests["r"].seqs[0]
    one = graphs.run([seq]).clone()
    after_one = engine.kv_cache.clone()
    graphs.sizes = [2]
    two = graphs.run([seq])
    assert two.shape == one.shape and torch.allclose(two, one, atol=1e-5)
    changed = (engine.kv_cache != after_one).flatten(1).any(1).nonzero().flatten().tolist()
    assert changed == [], changed  # rewrote the same slot with the same values only
    assert not torch.equal(after_one, before)
    engine.abort("r")


class _NoEvent:  # the CUDA event a prefilled request is reported with; no device here
    def record(self, stream) -> None:
        pass


def test_a_node_with_a_layer_hook_still_decodes_through_the_graphs(checkpoint_dirs, hf_greedy, monkeypatch):
    """A node serving both roles holds the layer-wise sends' hook. A step with a hook runs
    eagerly, so only steps with prefill-only requests get it, and only those requests'
    ranges: the other requests decode through the graphs."""
    monkeypatch.setattr(torch.cuda, "Event", _NoEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    llm = gpu_path_llm(checkpoint_dirs("llama"), max_num_seqs=4, page_size=4)
    engine, graphs = llm.engine, llm.engine.runner.graphs
    hooked, graph_batches = set(), []
    engine.layer_hook = lambda layer, ranges: hooked.update(r[0] for r in ranges)
    replay = graphs.run
    graphs.run = lambda seqs: graph_batches.append(len(seqs)) or replay(seqs)
    prompt = [5, 6, 7, 8, 9] * 3
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request("sent", prompt, params, prefill_only=True)
    engine.add_request("served", prompt[::-1], params)
    final = None
    while engine.has_unfinished():
        final = next((o for o in engine.step() if o.request_id == "served" and o.finished), final)
    assert final.outputs[0].token_ids == hf_greedy("llama", tuple(prompt[::-1]), 6)
    assert hooked == {"sent"} and graph_batches == [1] * 5  # every decode step, replayed
    assert engine.release("sent") and engine.num_free_pages() == engine.num_total_pages()


@pytest.mark.parametrize("family", ["gemma3", "gemma2", "exaone4", "cohere2", "starcoder2"])
def test_the_gpu_path_runs_sliding_windows_and_capped_scores_past_the_window(checkpoint_dirs, hf_greedy, family):
    # 8-token windows; Gemma 2's scores capped; EXAONE 4's full layer rotating nothing (Cohere 2's
    # too, beside its LayerNorms; StarCoder2's with biases). The graphs run the sliding layers' window too.
    llm = gpu_path_llm(checkpoint_dirs(family), max_num_seqs=4, page_size=3, max_num_batched_tokens=16)
    assert llm.engine.max_model_len == 2048
    prompts = [[5, 6, 7, 8, 9] * 4, [10, 11, 12]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(family, tuple(prompt), 8), prompt


def test_the_gpu_path_runs_longrope_past_its_original_context(checkpoint_dirs, hf_greedy):
    """The GPU step path and its graphs look up LongRoPE's long rows (engine/model/rope.py;
    the phi3 family's original context is 32 positions): a long prompt, and sequences that
    grow past 32 and are computed again, while the graphs decode the others."""
    llm = gpu_path_llm(checkpoint_dirs("phi3"), max_num_seqs=4, page_size=3, max_num_batched_tokens=16)
    graphs, replays = llm.engine.runner.graphs, []
    run = graphs.run
    graphs.run = lambda seqs: replays.append([s.long_rope for s in seqs]) or run(seqs)
    prompts = [list(range(3, 32)), list(range(40, 75)), list(range(100, 125))]  # 29, 35, 25 tokens
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy("phi3", prompt, 10), len(prompt)
    assert {True, False} <= {long for rows in replays for long in rows}  # graphed steps of both kinds
    assert llm.engine.num_free_pages() == llm.engine.num_total_pages()

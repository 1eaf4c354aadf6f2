"""A tensor-parallel engine (rank 0 here, ranks 1.. as child processes on gloo) gives the
greedy output of transformers for every family, with KV heads split unevenly (3 heads on
2 ranks) or replicated (1 head on 2 ranks), and q and k normed over heads on several
ranks; each rank's pool holds only its heads; heads that cannot split are refused naming
the numbers; the ranks start before rank 0 loads its weights; a start that fails (rank 0's
check, or a rank that exits) says why; and neither a start nor a close leaves a rank behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.checkpoint import FAMILIES, write_checkpoint
from pdserve.engine.tp.shard import split_model
from pdserve.procs import pid_alive

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
# A family for each way a model's weights or layers split over ranks otherwise (a rank starts
# in seconds, so not every family: the rest differ from these in what each rank runs alike,
# and run on one rank in every other test): plain, biases (row-parallel ones once), q and k
# normed by head, after rope or over every head, fused projections, multipliers, windows and
# caps, rope by layer kind, reordered partial rope, ungated MLPs and xIELU's parameters,
# experts (shared, gated, stacked, grouped, with biases), sinks, an LM head's bias, attention
# and the MLP side by side (Cohere: two all-reduces of one layer's input).
# (GPT-OSS's biases cover Qwen2's and ERNIE 4.5's; OLMoE and GraniteMoeSWA only combine what
# OLMo 2, Granite, the experts and GPT-OSS's sinks split; Llama 4's experts split as Mixtral's.)
TP_FAMILIES = ("llama", "qwen3", "phi3", "granite", "gemma2", "gemma3", "olmo2", "glm4", "arcee", "apertus",
               "hunyuan_v1_dense", "mixtral", "qwen2_moe", "gpt_oss", "glm4_moe", "ernie4_5_moe", "cohere")


def tp_llm(model_dir: str, tp: int = 2, **kw) -> LLM:
    return LLM(model_dir, page_size=4, num_pages=96, tensor_parallel_size=tp, num_threads=1, **kw)


def generate_and_close(llm: LLM, prompts, params: SamplingParams = GREEDY) -> list[list[int]]:
    try:
        outs = [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.num_free_pages() == llm.engine.num_total_pages()
        return outs
    finally:
        llm.close()


def test_the_split_families_are_families():
    assert set(TP_FAMILIES) <= set(FAMILIES) and len(set(TP_FAMILIES)) == len(TP_FAMILIES)


@pytest.mark.parametrize("family", TP_FAMILIES)
def test_two_ranks_match_transformers(family, checkpoint_dirs, hf_greedy, prompts_of_lengths):
    prompts = prompts_of_lengths([1, 9, 30], seed=7)
    # Stopping at EOS, as the reference does.
    outs = generate_and_close(tp_llm(checkpoint_dirs(family)), prompts, SamplingParams(max_tokens=8, temperature=0.0))
    assert outs == [hf_greedy(family, p, 8) for p in prompts]


def _hf(model_dir: str, prompts) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        outs.append(out[0, len(p):].tolist())
    return outs


@pytest.mark.parametrize("kv_heads, heads, pools, order", [(3, 9, [1, 2], "page-major"), (1, 4, [1, 1], "page-major"),
                                                          (3, 9, [1, 2], "layer-major")])
def test_uneven_and_replicated_kv_heads_match_transformers(kv_heads, heads, pools, order, tmp_path,
                                                           prompts_of_lengths):
    from pdserve.kvtransfer.layout import KVLayout

    model_dir = str(write_checkpoint(tmp_path / "m", seed=5, hidden_size=8 * heads, num_attention_heads=heads,
                                     num_key_value_heads=kv_heads))
    prompts = prompts_of_lengths([5, 21], seed=8)
    llm = tp_llm(model_dir, kv_layout=order)
    assert [p.shape[-2] for p in llm.engine.kv_pools] == pools
    assert {KVLayout.from_tensor(p, 4).kind for p in llm.engine.kv_pools} == {order}  # every rank's
    assert llm.engine.kv_head_begins == ([0, 1] if kv_heads == 3 else [0, 0])
    assert generate_and_close(llm, prompts) == _hf(model_dir, prompts)


def test_heads_that_cannot_split_are_refused_naming_them():
    with pytest.raises(ValueError, match="tensor_parallel_size 3 cannot split 2 KV heads"):
        split_model(4, 2, 128, 3)
    assert [(s.kv_begin, s.kv_end, s.q_begin, s.q_end) for s in split_model(4, 2, 128, 4)] == \
        [(0, 1, 0, 1), (0, 1, 1, 2), (1, 2, 2, 3), (1, 2, 3, 4)]


def test_a_gpu_device_is_refused_with_the_way_out(checkpoint_dirs):
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1 on device 'cuda'"):
        LLM(checkpoint_dirs("llama"), tensor_parallel_size=2, device="cuda")


def followers() -> list[int]:
    """This process's children that run a rank."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid == os.getpid() and b"pdserve.engine.tp.follower" in (stat.parent / "cmdline").read_bytes():
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            pass  # gone meanwhile
    return found


def test_the_ranks_start_before_rank_0_loads_its_weights(checkpoint_dirs, monkeypatch):
    import pdserve.engine.engine as engine_module

    running_then, load_rank = [], engine_module.load_rank

    def loading(*args):
        running_then.append(followers())  # already reading the config, or loading their shares
        return load_rank(*args)

    monkeypatch.setattr(engine_module, "load_rank", loading)
    tp_llm(checkpoint_dirs("llama")).close()
    assert [len(pids) for pids in running_then] == [1]


def test_a_split_refused_once_the_ranks_started_leaves_none_behind(checkpoint_dirs):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 cannot split 2 KV heads"):
        tp_llm(checkpoint_dirs("llama"), tp=3)
    assert followers() == []


def test_a_rank_that_exits_while_starting_fails_the_start_naming_it(checkpoint_dirs, tmp_path, monkeypatch):
    # Rank 1 exits as its interpreter starts (rank 0's environment is the ranks'): rank 0
    # raises, where it would wait for it to join, and no rank is left.
    (tmp_path / "sitecustomize.py").write_text("import os\nos._exit(7)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 exited \(code 7\) while loading its weights"):
        tp_llm(checkpoint_dirs("llama"))
    assert followers() == []


def test_close_stops_every_rank(checkpoint_dirs):
    llm = tp_llm(checkpoint_dirs("llama"))
    pids = [p.pid for p in llm.engine.tp._procs]
    llm.close()
    assert pids and not any(pid_alive(p) for p in pids)


def test_norms_over_every_head_match_transformers_with_a_kv_head_on_both_ranks(tmp_path, prompts_of_lengths):
    # OLMo 2 norms q and k over all heads: each rank's sum of squares is all-reduced, and a
    # replicated KV head's counted once. The prompt's logprobs show a k norm off by any factor.
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = str(write_checkpoint(tmp_path / "m", "olmo2", seed=6, num_key_value_heads=1))
    prompt = prompts_of_lengths([17], seed=9)[0]
    llm = tp_llm(model_dir)
    assert llm.engine.kv_head_begins == [0, 0]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    try:
        out = llm.generate([prompt], params)[0]
    finally:
        llm.close()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1], dim=-1)
    chosen = want.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor([s.logprob for s in out.prompt_logprobs]), chosen, atol=1e-4, rtol=0)
    assert out.token_ids == _hf(model_dir, [prompt])[0]

"""LoRA adapters (engine/lora.py): rows of several adapters and of none share a step, and each
request's greedy output equals PEFT's on transformers with its adapter; adapters' prompts
never share cached pages; an adapter this cannot run is refused when it loads, naming why."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.checkpoint import write_checkpoint, write_lora_adapter
from pdserve.engine.lora import LoraError

NEW = 8


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("lora") / "base", family="llama", seed=0)


@pytest.fixture(scope="module")
def adapters(base):
    root = base.parent
    return {"all": write_lora_adapter(base, root / "all", seed=1),
            "qv": write_lora_adapter(base, root / "qv", seed=2, rank=2, alpha=16, targets=("q_proj", "v_proj"),
                                     use_rslora=True)}


def peft_greedy(base_dir, adapter_dir, prompt, n=NEW):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir))
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.eval().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def run_all(engine, requests, n=NEW) -> list[list[int]]:
    """The greedy tokens of each (prompt, lora) request, all added before the first step."""
    for i, (prompt, lora) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0), lora=lora)
    outs = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    assert engine.num_free_pages() == engine.num_total_pages()
    return [outs[f"r{i}"] for i in range(len(requests))]


def served(base, adapters, **kwargs):
    return LLM(str(base), lora_modules=[f"{n}={d}" for n, d in adapters.items()], **kwargs)


def test_a_step_mixing_adapters_matches_peft_for_each(base, adapters, prompts_of_lengths):
    llm = served(base, adapters, page_size=4, num_pages=128, max_num_batched_tokens=16)
    prompts = prompts_of_lengths([9, 23, 14, 5, 30, 11], seed=3)
    loras = ["all", "", "qv", "all", "qv", ""]
    outs = run_all(llm.engine, list(zip(prompts, loras)))
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        assert outs[i] == peft_greedy(base, adapters.get(lora), prompt), (i, lora)
    assert outs[0] != peft_greedy(base, None, prompts[0])  # the adapter matters


def test_an_adapters_prompt_finds_only_its_own_cached_pages(base, adapters, prompts_of_lengths):
    llm = served(base, adapters, page_size=4, num_pages=64)
    prompt = prompts_of_lengths([21], seed=4)[0]
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    cached = []
    for lora in ("all", "qv", "", "all"):
        llm.engine.add_request(lora or "base", prompt, greedy, lora=lora)
        while llm.engine.has_unfinished():
            cached += [o.num_cached_tokens for o in llm.engine.step() if o.finished]
        llm.engine.requests.clear()
    assert cached == [0, 0, 0, 20]


def test_an_unknown_adapter_is_refused_naming_the_ones_there(base, adapters):
    llm = served(base, adapters, num_pages=16)
    with pytest.raises(ValueError, match="lora 'nope' is not an adapter of this engine; it has: all, qv"):
        llm.engine.add_request("x", [5, 6, 7], SamplingParams(max_tokens=1), lora="nope")
    assert llm.engine.num_free_pages() == llm.engine.num_total_pages()


def edited(adapter_dir, tmp_path, **fields):
    import shutil

    out = tmp_path / "edited"
    shutil.copytree(adapter_dir, out)
    config = out / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **fields}))
    return out


@pytest.mark.parametrize("fields, says", [
    ({"use_dora": True}, "use_dora True is not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save ['lm_head'] is not supported")])
def test_an_adapter_this_cannot_run_is_refused_naming_it(base, adapters, tmp_path, fields, says):
    with pytest.raises(LoraError, match=says.replace("[", r"\[").replace("]", r"\]")):
        served(base, {"bad": edited(adapters["qv"], tmp_path, **fields)}, num_pages=8)


def test_an_adapter_of_another_model_is_refused(base, tmp_path):
    other = write_checkpoint(tmp_path / "other", family="llama", hidden_size=32, intermediate_size=64)
    with pytest.raises(LoraError, match="does not fit this model"):
        served(base, {"other": write_lora_adapter(other, tmp_path / "a", targets=("q_proj",))}, num_pages=8)


def test_the_lm_heads_adapter_is_refused(base, tmp_path):
    adapter = write_lora_adapter(base, tmp_path / "head", targets=("lm_head",))
    with pytest.raises(LoraError, match="lm_head"):
        served(base, {"head": adapter}, num_pages=8)


def test_phi3s_fused_projections_take_their_adapters(tmp_path, prompts_of_lengths):
    base = write_checkpoint(tmp_path / "phi3", family="phi3")
    adapter = write_lora_adapter(base, tmp_path / "fused", targets=("qkv_proj", "gate_up_proj", "o_proj"))
    llm = served(base, {"fused": adapter}, page_size=4, num_pages=64)
    prompt = prompts_of_lengths([17], seed=5)[0]
    assert run_all(llm.engine, [(prompt, "fused")]) == [peft_greedy(base, adapter, prompt)]


def test_a_mixture_of_experts_takes_attention_adapters_and_refuses_mlp_ones(tmp_path, prompts_of_lengths):
    base = write_checkpoint(tmp_path / "moe", family="qwen3_moe")  # layer 0's MLP dense, layer 1's experts
    attention = write_lora_adapter(base, tmp_path / "attn", targets=("q_proj", "v_proj", "o_proj"))
    llm = served(base, {"attn": attention}, page_size=4, num_pages=64)
    prompt = prompts_of_lengths([13], seed=6)[0]
    assert run_all(llm.engine, [(prompt, "attn")]) == [peft_greedy(base, attention, prompt)]
    experts = write_lora_adapter(base, tmp_path / "experts", targets=("q_proj", "down_proj"))
    with pytest.raises(LoraError, match=r"target_parameters \['down_proj'\] \(an adapter of a mixture of experts'"):
        served(base, {"experts": experts}, num_pages=8)
    dense = write_checkpoint(tmp_path / "dense", family="qwen3")  # the same shapes, its MLPs dense
    mlp = write_lora_adapter(dense, tmp_path / "mlp", targets=("q_proj", "down_proj"))
    with pytest.raises(LoraError, match="layer 0 down_proj is an MLP projection, and this model's MLPs are mixtures"):
        served(base, {"mlp": mlp}, num_pages=8)


@pytest.mark.parametrize("family, geometry, targets", [
    ("llama", dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=3), None),  # 1 and 2 KV heads a rank
    ("phi3", dict(num_key_value_heads=1), ("qkv_proj", "gate_up_proj", "o_proj", "down_proj")),  # one head on both
    ("arcee", {}, ("q_proj", "up_proj", "down_proj")),  # an MLP without a gate
    ("ernie4_5", {}, ("q_proj", "k_proj", "o_proj"))])  # q's and k's rows reordered (GPT-J's rotary pairs)
def test_tensor_parallel_ranks_each_add_their_share_of_an_adapter(tmp_path, prompts_of_lengths, family, geometry,
                                                                   targets):
    base = write_checkpoint(tmp_path / "base", family=family, **geometry)
    adapter = write_lora_adapter(base, tmp_path / "a", seed=3, **({"targets": targets} if targets else {}))
    llm = served(base, {"a": adapter}, page_size=4, num_pages=64, tensor_parallel_size=2, num_threads=1)
    try:
        prompts = prompts_of_lengths([9, 17, 5], seed=7)
        requests = [(prompts[0], "a"), (prompts[1], ""), (prompts[2], "a")]  # one step holds both kinds of rows
        assert run_all(llm.engine, requests) == [peft_greedy(base, adapter if lora else None, prompt)
                                                 for prompt, lora in requests]
    finally:
        llm.close()

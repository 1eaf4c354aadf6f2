"""Which checkpoints the engine serves (engine/model/arch.py): another kind is refused before
its weights load, naming what it is; where transformers attends otherwise past some length
(a sliding window, LongRoPE), output past it is transformers'."""

from __future__ import annotations

import json
import random

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.checkpoint import write_checkpoint, write_tokenizer
from pdserve.engine.model.arch import UnsupportedModel
from pdserve.router.tokenizer import PromptTokenizer


def greedy_pair(model_dir, prompt, n, **engine_args):
    """(transformers' greedy continuation, the engine's) of `prompt`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    llm = LLM(str(model_dir), page_size=4, num_pages=64, **engine_args)
    ours = llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0))[0]
    assert llm.engine.num_free_pages() == llm.engine.num_total_pages()
    return ref[0, len(prompt):].tolist(), ours.token_ids, llm


def olmo_checkpoint(path):
    """A tiny OLMo (the first): Llama's weight names, but LayerNorms with neither weight nor
    bias, which a Llama's loader, finding no norm weights, would leave out without a word."""
    from transformers import AutoModelForCausalLM, OlmoConfig

    write_tokenizer(path)
    config = OlmoConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    return path


def edit_config(model_dir, **fields):
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def test_a_model_of_another_kind_is_refused_naming_it(tmp_path):
    with pytest.raises(UnsupportedModel, match=r"model_type 'olmo' \(OlmoForCausalLM\) is not supported"):
        LLM(str(olmo_checkpoint(tmp_path)), num_pages=8)


@pytest.mark.parametrize("fields, says", [
    ({"hidden_act": "relu"}, "hidden_act 'relu' is not supported"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quant_method 'gptq'"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ({"clip_qkv": 8.0}, "clip_qkv 8.0 is not supported")])
def test_a_supported_kind_run_otherwise_is_refused(tmp_path, fields, says):
    d = write_checkpoint(tmp_path / "m", family="llama")
    edit_config(d, **fields)
    with pytest.raises(UnsupportedModel, match=says):
        LLM(str(d), num_pages=8)


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("family, fields", [("cohere", {"use_qk_norm": True}),  # as Command R+
                                            ("stablelm", {"qk_layernorm": True, "use_parallel_residual": True})])  # 2 12B
def test_layer_norms_of_each_head_of_q_and_k_match_transformers(tmp_path, family, fields, ranks):
    # Each head's weights are random, so a rank holding another head's, or none, gives other
    # tokens; Cohere's rotary pairs are adjacent and StableLM's cover a quarter of each head,
    # so both norms' weights are reordered as q's and k's dimensions are.
    d = write_checkpoint(tmp_path / "m", family=family, **fields)
    ref, ours, llm = greedy_pair(d, list(range(3, 30)), 8, tensor_parallel_size=ranks)
    llm.close()
    assert ours == ref


def test_stablelm_with_a_parallel_residual_runs_attention_and_the_mlp_side_by_side(tmp_path):
    d = write_checkpoint(tmp_path / "slm", family="stablelm", use_parallel_residual=True)  # (as StableLM 2 12B)
    ref, ours, _ = greedy_pair(d, list(range(3, 30)), 8)
    assert ours == ref


def test_a_top_k_by_layer_is_refused_naming_it(tmp_path):
    d = write_checkpoint(tmp_path / "m", family="hunyuan_v1_moe")
    edit_config(d, moe_topk=[2, 1])
    with pytest.raises(UnsupportedModel, match=r"moe_topk differs by layer \(\[2, 1\]\)"):
        LLM(str(d), num_pages=8)


@pytest.mark.parametrize("family, fields", [
    ("mistral", {"sliding_window": 12}),
    ("phi3", {"sliding_window": 12}),
    ("qwen2", {"sliding_window": 12, "use_sliding_window": True, "max_window_layers": 1})])  # layer 1's alone
def test_a_sliding_window_is_run_past_its_length_not_cut(tmp_path, family, fields):
    d = write_checkpoint(tmp_path / family, family=family, **fields)
    ref, ours, llm = greedy_pair(d, list(range(3, 30)), 12)  # 27 tokens, and 12 more
    assert ours == ref
    assert llm.engine.max_model_len == 2048  # the model's own


@pytest.mark.parametrize("ranks", [1, 2])
def test_longrope_past_its_original_context_is_transformers_generate(checkpoint_dirs, hf_greedy, ranks):
    """The phi3 family is Phi-3.5's kind (engine/families.py): past 32 positions transformers
    rotates by the long factors, a prompt longer than 32 wholly, and a sequence that grows
    past it is computed again so (Phi-3's generate drops its cache there). Prompts one at a
    time, sharing a beginning, so the prefix cache holds short-factor pages a long prompt
    must not take; then all at once, in 16-token chunks."""
    d = checkpoint_dirs("phi3")
    rng = random.Random(0)
    start = [rng.randrange(3, 500) for _ in range(60)]
    # 27 and 31 cross 32 while decoding, 32 at its first token; 33 and 40 are long prompts.
    prompts = [start[:27], start[:32], start[:33], start[:40], start[:31]]
    new = 10
    want = [hf_greedy("phi3", p, new) for p in prompts]
    llm = LLM(str(d), page_size=4, num_pages=128, max_num_batched_tokens=16, tensor_parallel_size=ranks)
    try:
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        alone = [llm.generate([p], params)[0] for p in prompts]
        one_by_one = [o.outputs[0].token_ids for o in alone]
        together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.num_free_pages() == llm.engine.num_total_pages()
    finally:
        llm.close()
    assert one_by_one == want
    assert together == want
    # Each prompt takes cached pages of its own kind only: the 32's short ones of the 27's
    # prompt; the 33's long ones, computed when the 32 grew past 32 positions; the 40's the
    # 33's; the 31's the 32's short ones. Computing again is no preemption.
    assert [o.num_cached_tokens for o in alone] == [0, 24, 32, 32, 28]
    assert llm.engine.scheduler.num_preemptions == 0
    assert llm.engine.max_model_len == 2048  # the model's own, not the original 32
    assert PromptTokenizer(d).card.max_model_len == 2048  # the router offers what the nodes serve


def test_granite_moes_shared_expert_runs_beside_its_routed_ones(tmp_path):
    d = write_checkpoint(tmp_path / "gms", family="granitemoeshared", shared_intermediate_size=96)
    ref, ours, _ = greedy_pair(d, list(range(3, 30)), 8)
    assert ours == ref


def test_capped_prefill_attention_in_blocks_of_queries_equals_transformers(tmp_path, monkeypatch):
    from pdserve.engine.attention import cpu_ops

    monkeypatch.setattr(cpu_ops, "_CAPPED_ROWS", 4)  # a 27-token prompt: 7 blocks, the last short
    d = write_checkpoint(tmp_path / "g2", family="gemma2")
    ref, ours, _ = greedy_pair(d, list(range(3, 30)), 8)
    assert ours == ref


def gemma3_multimodal_checkpoint(path):
    """A tiny Gemma 3 of 4B's kind: a vision tower beside the language model, whose weights
    are saved under language_model.*."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    from pdserve.engine.families import config_of as _config

    write_tokenizer(path)
    text = _config("gemma3", 512)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=32, patch_size=8)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                                        mm_tokens_per_image=4, image_token_index=5))
    with torch.no_grad():  # norms of 1 + weight: random weights show a missing offset
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "vision" not in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(str(path))
    return path


def test_a_multimodal_gemma3_serves_its_language_model_as_transformers_runs_it(tmp_path):
    d = gemma3_multimodal_checkpoint(tmp_path / "g3mm")
    rng = random.Random(2)
    ref, ours, llm = greedy_pair(d, [rng.randrange(6, 512) for _ in range(27)], 10)  # past the 8-token window
    assert ours == ref
    assert llm.engine.max_model_len == 2048
    card = PromptTokenizer(str(d)).card  # the router reads the text model's figures too
    assert (card.vocab_size, card.max_model_len) == (512, 2048)


@pytest.mark.parametrize("text", ["mistral", "ministral3"])  # Mistral Small 3.1/3.2; Ministral 3
def test_a_multimodal_mistral3_serves_its_language_model_as_transformers_runs_it(tmp_path, text):
    import torch
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PixtralVisionConfig

    from pdserve.engine.families import config_of as _config

    d = tmp_path / "m3"
    write_tokenizer(d)
    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 image_size=32, patch_size=8, head_dim=16)
    torch.manual_seed(0)
    model = Mistral3ForConditionalGeneration(Mistral3Config(
        text_config=_config(text, 512).to_dict(), vision_config=vision.to_dict(), image_token_index=5,
        tie_word_embeddings=False))  # Mistral Small's own LM head, saved as language_model.lm_head
    model.save_pretrained(str(d))
    ids = [random.Random(3).randrange(6, 512) for _ in range(40)]  # Ministral 3 scales queries from position 16 on
    with torch.inference_mode():
        ref = Mistral3ForConditionalGeneration.from_pretrained(str(d)).eval().generate(
            torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    ours = LLM(str(d), page_size=4, num_pages=32).generate([ids], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert ours.token_ids == ref


def test_llama4_runs_within_its_first_attention_chunk(tmp_path, caplog):
    # Past attention_chunk_size its rope layers attend within chunks, which no backend masks.
    d = write_checkpoint(tmp_path / "l4", family="llama4", attention_chunk_size=40)
    ref, ours, llm = greedy_pair(d, list(range(3, 30)), 8)  # positions 7 on: the NoPE layer's queries scaled
    assert ours == ref
    assert llm.engine.max_model_len == 40
    with caplog.at_level("WARNING"):
        assert LLM(str(d), num_pages=8, max_model_len=64).engine.max_model_len == 40
    assert "max_model_len 64 is cut to 40, Llama 4's attention_chunk_size (40)" in caplog.text
    assert PromptTokenizer(str(d)).card.max_model_len == 40
    config = json.loads((d / "config.json").read_text())
    del config["layer_types"]  # as the released checkpoints' configs: transformers fills it in
    (d / "config.json").write_text(json.dumps(config))
    assert LLM(str(d), num_pages=8).engine.max_model_len == PromptTokenizer(str(d)).card.max_model_len == 40


def test_exaone_3_loads_its_released_names_as_transformers_renames_them(tmp_path):
    from safetensors.torch import load_file, save_file

    d = write_checkpoint(tmp_path / "ex", family="exaone")
    hub = [("model.embed_tokens.", "transformer.wte."), ("model.layers.", "transformer.h."), ("model.norm.", "transformer.ln_f."),
           (".self_attn.o_proj.", ".attn.attention.out_proj."), (".self_attn.", ".attn.attention."),
           (".input_layernorm.", ".ln_1."), (".post_attention_layernorm.", ".ln_2."), (".mlp.gate_proj.", ".mlp.c_fc_0."),
           (".mlp.up_proj.", ".mlp.c_fc_1."), (".mlp.down_proj.", ".mlp.c_proj.")]

    def released(name):
        for ours, theirs in hub:
            name = name.replace(ours, theirs)
        return name

    weights = load_file(str(d / "model.safetensors"))
    save_file({released(k): v for k, v in weights.items()}, str(d / "model.safetensors"), metadata={"format": "pt"})
    assert "transformer.h.0.attn.attention.out_proj.weight" in load_file(str(d / "model.safetensors"))
    ref, ours, _ = greedy_pair(d, list(range(3, 30)), 8)
    assert ours == ref

"""Multimodal checkpoints whose language model is a family served (engine/model/weights.py
TEXT_PARTS): the language model alone loads, its vision weights never kept, and text in
gives transformers' own greedy tokens from the whole multimodal model. (Gemma 3's and
Mistral 3's are in test_architectures.py.)"""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.checkpoint import write_checkpoint, write_tokenizer
from pdserve.engine.families import config_of
from pdserve.engine.model.weights import load_state_dict


def save_multimodal(d, kind: str, text_config, vision_config, text_weights=None, random_text=False, **fields):
    """`kind`'s ForConditionalGeneration (its transformers prefix: "Llama4", "AyaVision", ...)
    saved into `d`. Its language model's weights: those of `text_weights` (a causal LM) if
    given, its LM head random, unlike the embeddings; or with `random_text`, all random at
    the tiny checkpoints' scale (norms about 1); or as transformers initialises them."""
    write_tokenizer(d)
    torch.manual_seed(0)
    config = getattr(transformers, f"{kind}Config")(text_config=text_config.to_dict(),
                                                    vision_config=vision_config, **fields)
    model = getattr(transformers, f"{kind}ForConditionalGeneration")(config)
    with torch.no_grad():
        if text_weights is not None:
            model.model.language_model.load_state_dict(text_weights.model.state_dict())
            model.lm_head.weight.normal_(0.0, 0.2)
        for name, p in model.named_parameters() if random_text else ():
            if "visual" not in name:
                p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.2)
    model.save_pretrained(str(d))
    return d


def greedy_both(d, kind: str, ids: list[int], n: int = 8) -> tuple[list[int], list[int]]:
    """(transformers' greedy tokens from the whole model, the engine's)."""
    with torch.inference_mode():
        ref = getattr(transformers, f"{kind}ForConditionalGeneration").from_pretrained(str(d)).eval().generate(
            torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
    ours = LLM(str(d), page_size=4, num_pages=32).generate([ids], SamplingParams(max_tokens=n, temperature=0.0))[0]
    assert not [name for name in load_state_dict(d, torch.float32) if not name.startswith(("model.", "lm_head."))]
    return ref, ours.token_ids


def test_a_multimodal_llama4_serves_its_language_model_as_transformers_runs_it(tmp_path):
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8, vision_output_dim=32, projector_input_dim=32, projector_output_dim=64)
    d = save_multimodal(tmp_path / "l4", "Llama4", config_of("llama4", 512), vision, image_token_index=5)
    ref, ours = greedy_both(d, "Llama4", [random.Random(4).randrange(6, 512) for _ in range(30)])
    assert ours == ref


SIGLIP = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
              num_attention_heads=2, image_size=32, patch_size=8)


@pytest.mark.parametrize("kind, image", [("AyaVision", "image_token_index"), ("Cohere2Vision", "image_token_id")])
def test_a_multimodal_cohere_serves_its_language_model_as_transformers_runs_it(tmp_path, kind, image):
    # Aya Vision 8B; Command A Vision: Cohere 2 language models
    d = save_multimodal(tmp_path / kind, kind, config_of("cohere2", 512), SIGLIP, **{image: 5})
    ref, ours = greedy_both(d, kind, [random.Random(5).randrange(6, 512) for _ in range(30)])  # past the 8-token window
    assert ours == ref


@pytest.mark.parametrize("kind, text", [("Qwen2VL", "qwen2"), ("Qwen2_5_VL", "qwen2"), ("Qwen3VL", "qwen3")])
def test_a_qwen_vl_serves_text_as_transformers_runs_it(tmp_path, kind, text):
    # Text alone has one position on each of M-RoPE's axes: the rotation of plain rope. The
    # whole model's LM head is its own (tie_word_embeddings False) while its text config's ties.
    config = config_of(text, 512, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                   "mrope_section": [2, 3, 3] if text == "qwen2" else [4, 4, 4]})
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=8) if kind == "Qwen2VL" else dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=8,
        **({"deepstack_visual_indexes": [0], "num_position_embeddings": 16} if kind == "Qwen3VL" else {}))
    text_model = transformers.AutoModelForCausalLM.from_pretrained(str(write_checkpoint(tmp_path / "text", family=text)))
    d = save_multimodal(tmp_path / kind, kind, config, vision, text_model, image_token_id=5, video_token_id=6,
                        vision_start_token_id=7, tie_word_embeddings=False)
    ids = [random.Random(3).randrange(8, 512) for _ in range(30)]
    ref, ours = greedy_both(d, kind, ids)
    assert ours == ref
    assert_prompt_logprobs(d, kind, ids)  # each position's, which its rotation changes


def assert_prompt_logprobs(d, kind: str, ids: list[int]) -> None:
    """The engine's logprob of each prompt token is the whole model's."""
    with torch.inference_mode():
        logits = getattr(transformers, f"{kind}ForConditionalGeneration").from_pretrained(str(d))(
            torch.tensor([ids])).logits[0, :-1].float()
    want = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    scored = LLM(str(d), page_size=4, num_pages=32).generate(
        [ids], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))[0].prompt_logprobs
    torch.testing.assert_close(torch.tensor([s.logprob for s in scored]), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("layout", ["saved", "released"])
def test_a_qwen3_vl_moe_serves_text_as_transformers_runs_it_from_either_experts_layout(tmp_path, layout):
    # transformers 5 saves the stacked experts [E, out, in]; the released checkpoints hold them [E, in, out].
    from safetensors.torch import load_file, save_file

    text = transformers.Qwen3VLMoeTextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, moe_intermediate_size=40, num_experts=4, num_experts_per_tok=2,
        mlp_only_layers=[0], rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=8,
                  deepstack_visual_indexes=[0], num_position_embeddings=16)
    d = save_multimodal(tmp_path / layout, "Qwen3VLMoe", text, vision, random_text=True)
    if layout == "released":
        weights = load_file(str(d / "model.safetensors"))
        save_file({k: v.transpose(1, 2).contiguous() if ".mlp.experts." in k else v for k, v in weights.items()},
                  str(d / "model.safetensors"), metadata={"format": "pt"})
    ids = [random.Random(3).randrange(8, 512) for _ in range(30)]
    ref, ours = greedy_both(d, "Qwen3VLMoe", ids)
    assert ours == ref
    assert_prompt_logprobs(d, "Qwen3VLMoe", ids)

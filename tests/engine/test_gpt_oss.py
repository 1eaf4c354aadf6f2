"""GPT-OSS beyond what every family's tests check (tests/engine/test_greedy_matches_transformers.py
runs its tiny checkpoint, sinks, clamp, windows and biases, against transformers): its
experts as OpenAI released them, quantized to MXFP4, served as transformers dequantizes them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.checkpoint import write_checkpoint
from pdserve.engine.model.arch import UnsupportedModel, architecture
from pdserve.engine.model.gpt_oss import dequantize_mxfp4
from pdserve.engine.model.weights import load_config


def random_mxfp4(shape, generator):
    """Codes and scales of an MXFP4 tensor [*shape] whose values stay near a trained model's
    (scales 2^-6 to 2^-4 of codes up to 6)."""
    *lead, rows, cols = shape
    blocks = torch.randint(0, 256, (*lead, rows, cols // 32, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(121, 124, (*lead, rows, cols // 32), dtype=torch.uint8, generator=generator)
    return blocks, scales


def quantize_experts(model_dir):
    """`model_dir`'s GPT-OSS experts replaced by MXFP4 ones, saved as the released checkpoints
    are (`*_blocks`, `*_scales` [experts, out, ...], the biases as they were)."""
    path = model_dir / "model.safetensors"
    state, g = load_file(path), torch.Generator().manual_seed(0)
    for key in [k for k in state if k.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
        experts, fan_in, fan_out = state.pop(key).shape
        state[key + "_blocks"], state[key + "_scales"] = random_mxfp4((experts, fan_out, fan_in), g)
    save_file(state, path, metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


def test_mxfp4_dequantizes_as_transformers_does():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = random_mxfp4((3, 8, 64), torch.Generator().manual_seed(1))
    scales[0, 0, 0] = 127  # 2^0, and the extremes of the exponent range a bfloat16 holds
    scales[1, 2, 1], scales[2, 7, 0] = 1, 254
    ours = dequantize_mxfp4(blocks, scales, torch.float32)
    assert ours.shape == (3, 8, 64)
    assert torch.equal(ours.transpose(1, 2), convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))


def test_mismatched_blocks_and_scales_are_refused_naming_their_shapes():
    blocks, scales = random_mxfp4((2, 4, 64), torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match=r"\(2, 4, 2, 16\).*\(2, 4, 1\)"):
        dequantize_mxfp4(blocks, scales[..., :1], torch.float32)


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory):
    return quantize_experts(write_checkpoint(tmp_path_factory.mktemp("gpt_oss_mxfp4"), "gpt_oss", seed=3,
                                             intermediate_size=64))  # MXFP4 blocks: 32 values of a row


def test_an_mxfp4_checkpoint_serves_as_transformers_dequantizes_it(mxfp4_dir):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    model = AutoModelForCausalLM.from_pretrained(str(mxfp4_dir), dtype=torch.float32,
                                                 quantization_config=Mxfp4Config(dequantize=True)).eval()
    llm = LLM(str(mxfp4_dir), page_size=4, num_pages=64)
    prompts = [[1, 17, 99, 4, 250, 31, 8, 77, 5, 300, 12, 6], list(range(3, 40))]
    ours = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))
    for prompt, out in zip(prompts, ours):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        assert out.token_ids == ref[0, len(prompt):].tolist(), f"prompt of {len(prompt)} tokens"
    assert llm.engine.num_free_pages() == llm.engine.num_total_pages()


def test_other_quantized_checkpoints_stay_refused(mxfp4_dir):
    config = load_config(mxfp4_dir)
    architecture(config)  # GPT-OSS's MXFP4: served
    config.quantization_config = {"quant_method": "gptq"}
    with pytest.raises(UnsupportedModel, match="quant_method 'gptq'"):
        architecture(config)

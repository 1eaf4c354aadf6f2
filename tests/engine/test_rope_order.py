"""Rotary layouts the kernels do not rotate natively (engine/model/arch.py `head_order`): GPT-J's
adjacent pairs, partial rotary dims with Llama's halves or adjacent pairs. Reordered at load,
q and k rotated by the kernels' tables (pairs (i, i + D/2), the tail still) score every
query against every key as the model's own rotation does."""

from __future__ import annotations

import types

import pytest
import torch

from pdserve.engine.model.arch import head_order, reorder_heads
from pdserve.engine.model.rope import RotaryTables, apply_rope

D, HEADS, POSITIONS = 16, 2, 40


def model_rotation(x: torch.Tensor, positions: torch.Tensor, R: int, interleaved: bool) -> torch.Tensor:
    """x [T, heads, D] rotated over its first R dims as transformers' Llama (halves) or GLM
    (adjacent pairs) does, the rest passing through."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, R, 2).float() / R))
    freqs = torch.outer(positions.float(), inv)[:, None]  # [T, 1, R/2]
    cos, sin = freqs.cos(), freqs.sin()
    rot, still = x[..., :R], x[..., R:]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    else:
        a, b = rot[..., :R // 2], rot[..., R // 2:]
        rotated = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    return torch.cat([rotated, still], dim=-1)


@pytest.mark.parametrize("factor", [1.0, 0.5, 0.25])
@pytest.mark.parametrize("interleaved", [False, True])
def test_reordered_rows_rotated_by_the_tables_score_as_the_model(factor, interleaved):
    R = int(D * factor)
    config = types.SimpleNamespace(rope_theta=10000.0, partial_rotary_factor=factor)
    order = head_order(D, R, interleaved)
    torch.manual_seed(0)
    q, k = torch.randn(POSITIONS, HEADS, D), torch.randn(POSITIONS, HEADS, D)
    positions = torch.arange(POSITIONS)
    want = torch.einsum("qhd,khd->hqk", model_rotation(q, positions, R, interleaved),
                        model_rotation(k, positions, R, interleaved))
    tables = RotaryTables(config, D, POSITIONS, torch.float32)
    moved = reorder_heads(torch.eye(HEADS * D), order)  # reordering the projections' rows reorders their outputs
    q, k = ((x.reshape(POSITIONS, -1) @ moved.T).reshape(x.shape) for x in (q, k))
    cos, sin = tables.lookup(positions)
    got = torch.einsum("qhd,khd->hqk", apply_rope(q, cos, sin), apply_rope(k, cos, sin))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_phi4_minis_partial_rope_through_its_fused_qkv_and_an_adapter_of_it_match_transformers(tmp_path):
    """Phi-4-mini: Phi-3's fused q|k|v rotating 3/4 of each head (LongRoPE's factors of that
    many pairs), reordered after the split; a LoRA adapter of qkv_proj reordered alike."""
    from pdserve.engine import LLM
    from pdserve.engine.checkpoint import write_checkpoint, write_lora_adapter
    from tests.engine.test_lora import peft_greedy, run_all

    pairs = 6  # of head_dim 16 at factor 0.75
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + i / 10 for i in range(pairs)], "long_factor": [4.0 + i for i in range(pairs)],
            "original_max_position_embeddings": 64}
    base = write_checkpoint(tmp_path / "phi4", family="phi3", max_position_embeddings=256, partial_rotary_factor=0.75,
                            original_max_position_embeddings=64, rope_parameters=rope)
    adapter = write_lora_adapter(base, tmp_path / "a", seed=2, targets=("qkv_proj", "o_proj"))
    llm = LLM(str(base), page_size=4, num_pages=64, lora_modules=[f"a={adapter}"])
    prompt = list(range(3, 30))
    assert run_all(llm.engine, [(prompt, None), (prompt, "a")], 8) == [peft_greedy(base, None, prompt, 8),
                                                                       peft_greedy(base, adapter, prompt, 8)]

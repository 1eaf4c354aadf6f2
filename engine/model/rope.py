"""Rotary position embedding tables, computed once for every position up to the model's
context length, with the same numerics as transformers (fp32 frequencies, rope scaling
types such as Llama 3's from `transformers.modeling_rope_utils`).

LongRoPE served past its original context (`long_from`, pdserve/context.py) has two sets
of frequencies, and which one rotates a token depends on its sequence, not on its position:
transformers rotates a sequence longer than that context by the long factors, every
position of it, and one that grows past it is computed again so (Phi-3's generate drops
its cache there; engine/scheduler.py does the same). The tables then hold 2 x
max_positions rows, the short factors' first and the long factors' after them, and a
token of a long sequence looks up row p + max_positions (`rope_index`). The kernels index
the tables by whatever they are given, so they need nothing of their own for it."""

from __future__ import annotations

import copy

import numpy as np
import torch


def inverse_frequencies(hf_config, head_dim: int, layer_type: str | None = None,
                        long: bool = False) -> tuple[torch.Tensor, float]:
    """`layer_type`: the layers' kind whose parameters to use, where a model has parameters by
    kind (Gemma 3: `rope_parameters["sliding_attention"]` and `["full_attention"]`); `long`:
    LongRoPE's long factors (transformers' for a sequence past the original context)."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", params.get("type", "default"))
    base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    if rope_type == "dynamic" and params.get("alpha"):
        # HunYuan's NTK-alpha, labelled "dynamic" but fixed: only the base stretches, by
        # alpha^(D / (D - 2)), whatever the length (transformers' HunYuan reads it so too).
        base, rope_type = base * params["alpha"] ** (head_dim / (head_dim - 2)), "default"
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"rope_type {rope_type!r} is not supported")
        kind = {} if layer_type is None else {"layer_type": layer_type}
        if long and rope_type == "longrope":
            kind["seq_len"] = params["original_max_position_embeddings"] + 1
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **kind)
        return inv_freq.float(), float(attention_scaling)
    dim = int(head_dim * params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)))
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (base**exponent), 1.0


class RotaryTables:
    """cos/sin halves [max_positions, head_dim / 2] so applying rope is four multiplies
    (2 x max_positions rows with LongRoPE's long half: the module's docstring).

    With partial rotary embeddings (a rotary dim R < head_dim) the first R/2 columns rotate
    and the rest are cos 1, sin 0: the q and k dimensions that rotate are put there at load
    (arch.head_order), the others pass through unchanged."""

    def __init__(self, hf_config, head_dim: int, max_positions: int, dtype: torch.dtype, device="cpu",
                 layer_type: str | None = None, long_from: int = 0):
        """`long_from`: LongRoPE's original context (the long half of rows is added), else 0."""
        kinds = (False, True) if long_from else (False,)
        halves = [self._rows(hf_config, head_dim, max_positions, layer_type, long) for long in kinds]
        self.cos = torch.cat([cos for cos, _ in halves]).to(dtype=dtype, device=device)
        self.sin = torch.cat([sin for _, sin in halves]).to(dtype=dtype, device=device)

    @staticmethod
    def _rows(hf_config, head_dim: int, max_positions: int, layer_type, long: bool):
        inv_freq, scaling = inverse_frequencies(hf_config, head_dim, layer_type, long)
        positions = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(positions, inv_freq)
        cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
        still = head_dim // 2 - inv_freq.numel()
        if still:
            cos = torch.cat([cos, torch.ones(max_positions, still)], dim=1)
            sin = torch.cat([sin, torch.zeros(max_positions, still)], dim=1)
        return cos, sin

    @classmethod
    def of_kind(cls, hf_config, kind: str, head_dim: int, max_positions: int, dtype, device,
                long_from: int = 0) -> "RotaryTables":
        """The tables of a layer kind (arch.Architecture.rope_kinds): "" the model's, a key of
        its rope parameters by layer type (Gemma 3's), or "theta=X", the model's parameters
        with that base (GraniteSWA's per-layer `layer_rope_theta`)."""
        if kind.startswith("theta="):
            hf_config = copy.deepcopy(hf_config)
            hf_config.rope_parameters = {**hf_config.rope_parameters, "rope_theta": float(kind[len("theta="):])}
            kind = ""
        return cls(hf_config, head_dim, max_positions, dtype, device, kind or None, long_from)

    def identity(self) -> "RotaryTables":
        """Tables of the same shape that rotate nothing (cos 1, sin 0: x * 1 + y * 0 is x
        exactly), for layers without rotary embeddings (SmolLM3's NoPE layers)."""
        tables = object.__new__(RotaryTables)
        tables.cos, tables.sin = torch.ones_like(self.cos), torch.zeros_like(self.sin)
        return tables

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D/2] for positions [T], broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def rope_index(positions: np.ndarray, max_positions: int, long: np.ndarray) -> np.ndarray:
    """The table rows of `positions`: those of a sequence LongRoPE's long factors rotate
    (`long`, each position's: Sequence.long_rope) in the long half."""
    return positions + max_positions * long


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated as transformers' `x * cos + rotate_half(x) * sin`."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

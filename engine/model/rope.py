"""Rotary position embedding tables, computed once for every position up to the model's
context length, with the same numerics as transformers (fp32 frequencies, rope scaling
types such as Llama 3's from `transformers.modeling_rope_utils`)."""

from __future__ import annotations

import copy

import torch


def inverse_frequencies(hf_config, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """`layer_type`: the layers' kind whose parameters to use, where a model has parameters by
    kind (Gemma 3: `rope_parameters["sliding_attention"]` and `["full_attention"]`)."""
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
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **kind)
        return inv_freq.float(), float(attention_scaling)
    dim = int(head_dim * params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)))
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (base**exponent), 1.0


class RotaryTables:
    """cos/sin halves [max_positions, head_dim / 2] so applying rope is four multiplies.

    With partial rotary embeddings (a rotary dim R < head_dim) the first R/2 columns rotate
    and the rest are cos 1, sin 0: the q and k dimensions that rotate are put there at load
    (arch.head_order), the others pass through unchanged."""

    def __init__(self, hf_config, head_dim: int, max_positions: int, dtype: torch.dtype, device="cpu",
                 layer_type: str | None = None):
        inv_freq, scaling = inverse_frequencies(hf_config, head_dim, layer_type)
        positions = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(positions, inv_freq)
        cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
        still = head_dim // 2 - inv_freq.numel()
        if still:
            cos = torch.cat([cos, torch.ones(max_positions, still)], dim=1)
            sin = torch.cat([sin, torch.zeros(max_positions, still)], dim=1)
        self.cos = cos.to(dtype=dtype, device=device)
        self.sin = sin.to(dtype=dtype, device=device)

    @classmethod
    def of_kind(cls, hf_config, kind: str, head_dim: int, max_positions: int, dtype, device) -> "RotaryTables":
        """The tables of a layer kind (arch.Architecture.rope_kinds): "" the model's, a key of
        its rope parameters by layer type (Gemma 3's), or "theta=X", the model's parameters
        with that base (GraniteSWA's per-layer `layer_rope_theta`)."""
        if kind.startswith("theta="):
            hf_config = copy.deepcopy(hf_config)
            hf_config.rope_parameters = {**hf_config.rope_parameters, "rope_theta": float(kind[len("theta="):])}
            kind = ""
        return cls(hf_config, head_dim, max_positions, dtype, device, kind or None)

    def identity(self) -> "RotaryTables":
        """Tables of the same shape that rotate nothing (cos 1, sin 0: x * 1 + y * 0 is x
        exactly), for layers without rotary embeddings (SmolLM3's NoPE layers)."""
        tables = object.__new__(RotaryTables)
        tables.cos, tables.sin = torch.ones_like(self.cos), torch.zeros_like(self.sin)
        return tables

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D/2] for positions [T], broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated as transformers' `x * cos + rotate_half(x) * sin`."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

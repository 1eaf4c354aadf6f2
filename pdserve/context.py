"""The longest context a checkpoint is served with, and where LongRoPE's long frequencies
begin, from its config alone. Where transformers attends otherwise past some length (Llama
4's attention by chunks), the engine stops there, where its output is still the model's.
The engine (engine/model/arch.py) and the router (router/tokenizer.py, which reads
config.json without transformers) both ask here, so a router never offers a context, or a
default max_tokens, that its nodes would refuse. The lowest layer, beside `arith`: it
imports nothing."""

from __future__ import annotations

from typing import Any, Callable


def context_limit(get: Callable[[str, Any], Any]) -> tuple[int, str]:
    """(the longest context, what cuts it below max_position_embeddings or "") of a text
    model's config read through `get(name, default)`: a transformers config's getattr or
    config.json's dict.get."""
    limit, why = get("max_position_embeddings", 0) or 0, ""
    # Llama 4's rope layers attend within chunks: before the first one ends, causally. (A
    # config.json without layer_types chunks those layers, as transformers fills it in.)
    chunk, types = get("attention_chunk_size", None), get("layer_types", None)
    if chunk and chunk < limit and (types is None or "chunked_attention" in types):
        limit, why = chunk, f"Llama 4's attention_chunk_size ({chunk}), past which its rope layers attend by chunk"
    return limit, why


def long_rope_from(get: Callable[[str, Any], Any]) -> int:
    """LongRoPE's original_max_position_embeddings where it is below the model's context,
    else 0. transformers rotates the tokens of a forward pass whose last position is at or
    past it by the long factors, the others by the short ones: a prompt longer than it all
    long, a token generated there long too, the cache of the earlier ones kept as it was."""
    params = get("rope_parameters", None) or get("rope_scaling", None) or {}
    if params.get("rope_type", params.get("type")) != "longrope":
        return 0
    original = params.get("original_max_position_embeddings") or get("original_max_position_embeddings", None)
    return original if original and original < (get("max_position_embeddings", 0) or 0) else 0

"""/v1/models and the `model` a request names: the served model under each of its names
(`--served-model-name`, its own first, as vLLM's), then its LoRA adapters (`--lora-modules`,
each with the model as its `parent`, as vLLM lists them), in the shape of the caller's API
(Anthropic's for a caller that says `anthropic-version`, router/http_keys.py)."""

from __future__ import annotations

from aiohttp import web

from . import anthropic_api, http_keys
from .openai_protocol import OpenAIError


def card(request: web.Request, name: str, created: int, max_model_len: int, parent: str | None = None) -> dict:
    """`name`'s entry; `parent`: the model an adapter runs on."""
    if http_keys.speaks_anthropic(request):
        return anthropic_api.model_info(name, created, max_model_len)
    entry = {"id": name, "object": "model", "created": created, "owned_by": "pdserve",
             "max_model_len": max_model_len}
    return entry if parent is None else {**entry, "parent": parent}


def listing(request: web.Request, names: list[str], created: int, max_model_len: int, loras=()) -> dict:
    """Every name; those in `loras` are adapters of the first."""
    cards = [card(request, name, created, max_model_len, names[0] if name in loras else None) for name in names]
    if http_keys.speaks_anthropic(request):
        return anthropic_api.model_page(cards, request.query)
    return {"object": "list", "data": cards}


def check(model, names: list[str]) -> None:
    """A 404 naming the served names unless `model` is one of them."""
    if model not in names:
        raise OpenAIError(404, f"The model `{model}` does not exist; this server serves "
                               f"`{'`, `'.join(names)}`.", "model", "model_not_found")

"""`pdserve models check DIR`: whether pdserve serves a checkpoint directory, and serves it as
transformers runs it: the greedy tokens of a prompt through the engine against transformers'
own model, both in float32 on the CPU (the model is held twice, one after the other).

transformers' tokens come from a plain loop of forward passes and argmax, with no end of
sequence, so both sides run the same number of steps whatever the checkpoint's stop tokens.
"""

from __future__ import annotations

DEFAULT_PROMPT = "The capital of France is"


def check_model(model_dir: str, prompt: str = DEFAULT_PROMPT, tokens: int = 16) -> dict:
    """{"model_type", "served", "reason"?, "prompt_tokens", "tokens", "identical",
    "first_difference", "pdserve", "transformers"}: UnsupportedModel's reason where the
    engine refuses the model (nothing is loaded then)."""
    from pdserve.engine.model.arch import UnsupportedModel, architecture
    from pdserve.engine.model.weights import load_config, load_tokenizer

    config = load_config(model_dir)
    out = {"model_type": getattr(config, "model_type", None)}
    try:
        architecture(config)
    except UnsupportedModel as err:
        return {**out, "served": False, "reason": str(err)}
    ids = list(load_tokenizer(model_dir).encode(prompt))
    ours = _pdserve_greedy(model_dir, ids, tokens)
    theirs = _transformers_greedy(model_dir, ids, tokens)
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    return {**out, "served": True, "prompt_tokens": len(ids), "tokens": tokens, "identical": ours == theirs,
            "first_difference": first, "pdserve": ours, "transformers": theirs}


def _pdserve_greedy(model_dir: str, ids: list[int], tokens: int) -> list[int]:
    from pdserve.engine import LLM, SamplingParams

    pages = -(-(len(ids) + tokens) // 16) + 1
    llm = LLM(model_dir, page_size=16, num_pages=pages, dtype="float32", device="cpu", max_model_len=len(ids) + tokens)
    try:
        return llm.generate([ids], SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))[0].token_ids
    finally:
        llm.close()


def _transformers_greedy(model_dir: str, ids: list[int], tokens: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    except ValueError:  # a multimodal model transformers runs only whole (Aya Vision, Qwen2.5-VL)
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    out, cache, step = [], None, torch.tensor([ids])
    with torch.inference_mode():
        for _ in range(tokens):
            result = model(step, cache=cache, use_cache=True)
            cache = result.cache
            out.append(int(result.logits[0, -1].argmax()))
            step = torch.tensor([[out[-1]]])
    return out

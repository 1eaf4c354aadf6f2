"""Fill in the middle: a completions request's `suffix`, for a code model trained to write
what goes between a prefix (the prompt) and a suffix.

Such a model's tokenizer has three special tokens, and the prompt puts them in
prefix-suffix-middle order: PREFIX prompt SUFFIX suffix MIDDLE, after which the model writes
the middle and ends with its eos. The tokens, by family (`FIM_TOKENS`): Qwen2.5-Coder's and
Qwen3-Coder's `<|fim_prefix|>`, StarCoder's and StarCoder2's `<fim_prefix>`, DeepSeek-Coder's
`<｜fim▁begin｜>`. A model whose tokenizer has none of these refuses a suffix (400) instead
of writing an answer that ignores it; so does `echo` beside one (its prompt is no longer
the text sent).
"""

from __future__ import annotations

from .openai_protocol import invalid

FIM_TOKENS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
              ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
              ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"))


def fim_ids(tokenizer) -> tuple[int, int, int] | None:
    """The (prefix, suffix, middle) token ids of a transformers `tokenizer`, or None."""
    vocab = tokenizer.get_vocab()
    return next((tuple(vocab[name] for name in names) for names in FIM_TOKENS
                 if all(name in vocab for name in names)), None)


def with_suffix(body: dict, prompts: list[list[int]], tokenizer, model: str) -> list[list[int]]:
    """`prompts` (each prompt's ids) as fill-in-the-middle prompts around the body's
    `suffix`; as they are when it is absent or empty. A prompt's leading bos stays first."""
    suffix = body.get("suffix")
    if suffix is None or suffix == "":
        return prompts
    if not isinstance(suffix, str):
        raise invalid(f"suffix must be a string, got {suffix!r:.80}", "suffix")
    if body.get("echo"):
        raise invalid("echo cannot be sent with suffix (the prompt served is the prefix, suffix and their "
                      "tokens): send one of them", "suffix")
    hf = tokenizer.tokenizer
    tokens = fim_ids(hf)
    if tokens is None:
        raise invalid(f"suffix needs a model trained to fill in the middle, and {model}'s tokenizer has no "
                      f"fill-in-the-middle tokens (such as {' '.join(FIM_TOKENS[0])}): leave suffix out",
                      "suffix")
    pre, suf, mid = tokens
    tail = [suf, *hf.encode(suffix, add_special_tokens=False), mid]
    bos = hf.bos_token_id
    return [[ids[0], pre, *ids[1:], *tail] if bos is not None and ids[:1] == [bos] else [pre, *ids, *tail]
            for ids in prompts]

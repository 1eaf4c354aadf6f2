"""vLLM's `/tokenize` and `/detokenize`: the served model's own token ids of a text or of a
conversation (rendered exactly as a chat request's prompt is), and the text of ids. A client
counts tokens, or checks a prompt against the context, without generating; no node works.

Bodies and answers are vLLM's: `{"prompt"}` (with `add_special_tokens`, default true) or
`{"messages"}` (with the chat request's `tools`, `add_generation_prompt`,
`continue_final_message`, `chat_template_kwargs`, `reasoning_effort`, `documents`), and
`return_token_strs`, answered with `{"count", "max_model_len", "tokens", "token_strs"}`;
`{"tokens"}` answered with `{"prompt"}`.
"""

from __future__ import annotations

from pdserve.router import validation
from pdserve.router.openai_protocol import chat_prompt, invalid, tools_of

TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens", "return_token_strs",
                             "tools", "tool_choice", "add_generation_prompt", "continue_final_message",
                             "chat_template_kwargs", "reasoning_effort", "documents"})


def tokenize(body: dict, tokenizer) -> dict:
    """The answer to a checked `/tokenize` body (its model already matched); OpenAIError 400
    naming a bad field."""
    _known(body, TOKENIZE_FIELDS, "tokenize")
    flags = {name: body.get(name, default) for name, default in
             (("add_special_tokens", True), ("return_token_strs", False))}
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise invalid(f"{name} must be a boolean, got {value!r:.80}", name)
    if ("prompt" in body) == ("messages" in body):
        raise invalid("send exactly one of prompt (a text) or messages (a conversation)", "prompt")
    if "messages" in body:
        ids = chat_prompt(body, tokenizer, tools_of(body))
    else:
        prompt, limit = body["prompt"], validation.max_prompt_chars(tokenizer.card)
        if not isinstance(prompt, str):
            raise invalid(f"prompt must be a text, got {prompt!r:.80}", "prompt")
        if len(prompt) > limit:
            raise invalid(f"prompt of {len(prompt)} characters is longer than the model's context can hold "
                          f"(at most {limit} characters)", "prompt")
        ids = list(tokenizer.tokenizer.encode(prompt, add_special_tokens=flags["add_special_tokens"]))
    return {"count": len(ids), "max_model_len": tokenizer.card.max_model_len, "tokens": ids,
            "token_strs": tokenizer.tokenizer.convert_ids_to_tokens(ids) if flags["return_token_strs"] else None}


def detokenize(body: dict, tokenizer) -> dict:
    """The answer to a checked `/detokenize` body: the text of its token ids."""
    _known(body, frozenset({"model", "tokens"}), "detokenize")
    tokens, vocab = body.get("tokens"), tokenizer.card.vocab_size
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise invalid(f"tokens must be a list of token ids, got {tokens!r:.80}", "tokens")
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise invalid(f"tokens must be ids in [0, {vocab}), got {bad[0]}", "tokens")
    return {"prompt": tokenizer.decode(tokens)}


def _known(body: dict, fields: frozenset, route: str) -> None:
    unknown = sorted(set(body) - fields)
    if unknown:
        raise invalid(f"unknown parameter {unknown[0]!r} for {route}", unknown[0])

"""What the router checks of a Generate request before any node sees it.

Everything here raises `ValueError` naming the field and the offending value (the service
answers INVALID_ARGUMENT). The prompt text is bounded before tokenizing
(`max_prompt_chars`), so a huge string cannot stall the event loop in the tokenizer;
messages over the gRPC size limit never get this far (the server answers
RESOURCE_EXHAUSTED). Sampling values obey the rules the engine keeps (`pdserve.sampling`,
the one copy), and the prompt plus `max_tokens` must fit the model's context (refused in
vLLM's words, naming both numbers): a bad request is refused here, at the front door,
before any prefill or decode node does work. A colocated node runs the same checks.

A request's prompt is exactly one of text, token ids or a conversation (`messages`, rendered
by the model's chat template: `PromptTokenizer.chat_ids`), with the tools it may call
(router/grpc_tools.py). A conversation also stops at the template's end of turn
(`chat_sampling`).
"""

from __future__ import annotations

from pdserve.kvtransfer.window import resolve_kv_window_end
from pdserve.runtime.checks import check_request_id, sampling_from_pb
from pdserve.sampling import check_context

from .grpc_tools import CallAnswers, held_to, tools_of_request

# A prompt text this many times the context (in characters) cannot fit: no tokenizer
# averages that many characters per token.
CHARS_PER_TOKEN_BOUND = 64


def max_prompt_chars(card) -> int:
    return max(1, card.max_model_len) * CHARS_PER_TOKEN_BOUND


def prompt_ids(request, tokenizer, tools=None) -> list[int]:
    """The prompt as token ids (exactly one of text, ids or messages, with the `tools` it
    offers, router/grpc_tools.py); raises ValueError."""
    given = [name for name in ("prompt", "prompt_token_ids", "messages") if getattr(request, name)]
    if len(given) > 1:
        raise ValueError(f"give exactly one of prompt, prompt_token_ids or messages, "
                         f"got {' and '.join(given)}")
    if request.prompt_token_ids:
        return list(request.prompt_token_ids)
    if request.messages:
        return tokenizer.chat_ids([message_dict(m) for m in request.messages], tools)
    limit = max_prompt_chars(tokenizer.card)
    if len(request.prompt) > limit:
        raise ValueError(f"prompt of {len(request.prompt)} characters is longer than the model's "
                         f"context can hold (at most {limit} characters)")
    return tokenizer.encode(request.prompt)


def message_dict(message) -> dict:
    """A `ChatMessage` as the chat code takes it (OpenAI's shape); an unset content is None
    (an error there, unless the turn carries calls)."""
    out = {"role": message.role, "content": message.content if message.HasField("content") else None}
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id or f"call_{n}", "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}}
                             for n, c in enumerate(message.tool_calls)]
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    return out


def chat_sampling(sampling, tokenizer):
    """A copy of `sampling` (a pdserve_pb2.SamplingParams) that also stops where the model
    ends its turn (`tokenizer.end_of_turn_ids`), even where that is not the config's eos.
    Not under ignore_eos: to a conversation the end of its turn is its eos, and ignore_eos
    means generating past it (benchmarks rely on that for fixed lengths)."""
    out = type(sampling)()
    out.CopyFrom(sampling)
    if not sampling.ignore_eos:
        out.stop_token_ids.extend(t for t in tokenizer.end_of_turn_ids
                                  if t not in sampling.stop_token_ids)
    return out


def sampling_of(request, tokenizer):
    """The sampling a Generate request runs with: a conversation's stops at its end of turn."""
    return chat_sampling(request.sampling, tokenizer) if request.messages else request.sampling


def check_prompt_ids(ids: list[int], vocab_size: int) -> None:
    """A non-empty prompt of in-vocabulary ids (its length: `check_context`)."""
    if not ids:
        raise ValueError("prompt is empty (0 tokens)")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")


def check_generate(request, ids: list[int], card, sampling, prompt_in: str = "prompt",
                   batch_index: int | None = None) -> None:
    """The router's checks of a Generate request whose prompt is `ids` and whose sampling,
    a conversation's stops included, is `sampling` (gRPC and HTTP alike). `prompt_in` names
    the prompt in the context error: "prompt", or "messages" for a conversation. A prompt of
    a batch (`batch_index`, OpenAI's list of prompts) is named in its errors: "prompt[1]: "."""
    check_request_id(request.request_id, required=False)
    params = sampling_from_pb(sampling)
    params.validate(card.vocab_size)
    try:
        check_prompt_ids(ids, card.vocab_size)
        if card.max_model_len > 1:  # (0: the config names no context)
            check_context(len(ids), params.max_tokens, card.max_model_len, prompt_in)
    except ValueError as err:
        if batch_index is None:
            raise
        raise ValueError(f"{prompt_in}[{batch_index}]: {err}") from None
    if request.HasField("kv_window_end"):
        resolve_kv_window_end(request.kv_window_end, len(ids))


def checked(request, tokenizer) -> tuple[list[int], object, CallAnswers | None]:
    """(prompt ids, sampling, what rewrites the answer's messages when it may call tools) of
    a Generate request after every front-door check."""
    tools = tools_of_request(request, tokenizer.tool_dialect)
    ids = prompt_ids(request, tokenizer, tools)
    sampling = held_to(sampling_of(request, tokenizer), tools)
    check_generate(request, ids, tokenizer.card, sampling,
                   "messages" if request.messages else "prompt")
    return ids, sampling, CallAnswers(tools) if tools is not None else None

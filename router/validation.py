"""What the router checks of a Generate request before any node sees it.

Everything here raises `ValueError` naming the field and the offending value (the
servicer answers INVALID_ARGUMENT); the workers check again at their own edge. The prompt
text is bounded before tokenizing (`max_prompt_chars`), so a huge string cannot stall the
event loop in the tokenizer; messages over the gRPC size limit never get this far (the
server answers RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

from proto.checks import check_prompt_ids, check_request_id, check_sampling, check_window_end

# A prompt text this many times the context (in characters) cannot fit: no tokenizer
# averages that many characters per token.
CHARS_PER_TOKEN_BOUND = 64


def max_prompt_chars(card) -> int:
    return max(1, card.max_model_len) * CHARS_PER_TOKEN_BOUND


def prompt_ids(request, tokenizer) -> list[int]:
    """The prompt as token ids (exactly one of text or ids); raises ValueError."""
    if request.prompt and request.prompt_token_ids:
        raise ValueError("give either prompt or prompt_token_ids, not both")
    if request.prompt_token_ids:
        return list(request.prompt_token_ids)
    limit = max_prompt_chars(tokenizer.card)
    if len(request.prompt) > limit:
        raise ValueError(f"prompt of {len(request.prompt)} characters is longer than the model's "
                         f"context can hold (at most {limit} characters)")
    return tokenizer.encode(request.prompt)


def check_generate(request, ids: list[int], card) -> None:
    check_request_id(request.request_id, required=False)
    max_len = card.max_model_len if card.max_model_len > 1 else 2**31 - 1
    check_prompt_ids(ids, card.vocab_size, max_len - 1)
    check_sampling(request.sampling, card.vocab_size, max_len)
    if request.HasField("kv_window_end"):
        check_window_end(request.kv_window_end, len(ids))

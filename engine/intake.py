"""A new request checked against what the engine can run, and built: its `Request` and its
sequences (one for a prefill-only request, else `params.n`).

Every way a request enters the engine (`add_request`, `prepare_receive`) comes through
`new_request`, so a bad value is refused the same way everywhere, with a ValueError that
names it, before anything is allocated: a structured output that does not compile too
(`grammars`: the engine's `structured.Grammars`; `bans`: its `bans.BanRules`).
"""

from __future__ import annotations

import torch

from pdserve.arith import ceil_div

from .bans import BanRules
from .capacity import KVCapacity
from .config import SamplingParams
from .penalties import penalties_of
from .sampler import SamplingRow
from .sequence import Request, Sequence


def new_request(request_id: str, prompt_token_ids, params: SamplingParams, prefill_only: bool, cache_salt,
                capacity: KVCapacity, vocab_size: int, new_detokenizer, arrival: int, grammars,
                bans: BanRules, adapters, lora: str = "", full_prompt_len: int = 0) -> Request:
    """`full_prompt_len`: the whole prompt's, where a prefill node computes only its start."""
    prompt = list(prompt_token_ids or [])
    if not prompt:
        raise ValueError("prompt must not be empty, got 0 tokens")
    bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size}), got {bad[0]!r}")
    max_len = capacity.max_model_len
    limit = max_len if prefill_only else max_len - 1
    if len(prompt) > limit:
        raise ValueError(f"prompt of {len(prompt)} tokens is longer than the model's context allows ({limit})")
    if ceil_div(len(prompt), capacity.page_size) > capacity.num_pages:
        raise ValueError(f"prompt of {len(prompt)} tokens needs more than the {capacity.num_pages} KV pages "
                         "of this engine")
    params.validate(vocab_size, max_len)
    if not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt must be a string, got {cache_salt!r}")
    adapter = adapters.index(lora)  # engine/lora.py Adapters: -1 for none; ValueError naming an unknown one
    # A structured output that does not compile is refused here, before anything is made.
    structured = params.structured_output is not None and not prefill_only
    constraints = grammars.constraints(params.structured_output, params.n) if structured else None
    # An adapter's KV is its own: its pages are cached under a salt of its own.
    salt = f"{cache_salt}\0lora:{lora}" if adapter >= 0 else cache_salt
    request = Request(request_id, prompt, params, prefill_only, arrival, cache_salt=salt, lora=adapter)
    long_rope = bool(capacity.long_rope_from) and max(len(prompt), full_prompt_len) > capacity.long_rope_from
    if params.prompt_logprobs is not None and not prefill_only:
        request.prompt_logprobs = []
    for i in range(1 if prefill_only else params.n):
        seq = Sequence(request, i, list(prompt), len(prompt), long_rope=long_rope)
        if params.seed is not None:
            seq.generator = torch.Generator().manual_seed(params.seed + i)
        seq.sampling = SamplingRow(params.temperature, params.top_k, params.top_p, params.min_p, seq.generator,
                                   params.logprobs, penalties_of(params, seq.token_ids, len(prompt)),
                                   constraints[i] if constraints else None,
                                   None if prefill_only else bans.of(params, seq.token_ids, len(prompt)))
        if not prefill_only:
            seq.detokenizer = new_detokenizer(prompt, params.skip_special_tokens)
        if params.logprobs is not None:
            seq.logprobs = []
        request.seqs.append(seq)
    return request

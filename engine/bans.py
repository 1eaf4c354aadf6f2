"""Tokens a sequence may not sample at a step, with vLLM's meanings:

- `min_tokens` k: until the output has k tokens, no stop token (an EOS unless `ignore_eos`,
  or one of `stop_token_ids`) can be sampled, and stop strings do not end it
  (engine/completion.py).
- `bad_words`: a word never appears as the model's tokens for it. Each word is tokenized
  twice, alone and after a space (the middle of a sentence); a one-token form is never
  sampled, and a longer one's last token is banned right after the output has written the
  rest. The output's tokens count, not the prompt's, as in vLLM.
- `allowed_token_ids`: every token not listed is banned at every step (vLLM's), EOS too
  unless listed.

A ban sets the logit to -inf before sampling (engine/sampler.py), greedy rows included. The
bans depend on the sequence's own tokens only, so a recomputed sequence continues exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .device import to_device

MAX_WORDS_KEPT = 4096


@dataclass(eq=False)
class Bans:
    """One sequence's bans. `token_ids` is its own list (prompt, then output), read as it grows."""

    token_ids: list[int]
    num_prompt_tokens: int
    min_tokens: int
    stop_ids: tuple[int, ...]
    always: tuple[int, ...]  # the last token of each one-token word form
    after: tuple[tuple[int, ...], ...]  # each longer form's ids
    allowed: torch.Tensor | None = None  # int64 ids: all the others are banned (None: any)

    def now(self) -> list[int]:
        """The token ids this sequence may not sample at its next step."""
        written = len(self.token_ids) - self.num_prompt_tokens
        banned = [*self.always, *(self.stop_ids if written < self.min_tokens else ())]
        for form in self.after:
            k = len(form) - 1
            if written >= k and self.token_ids[-k:] == list(form[:-1]):
                banned.append(form[-1])
        return banned


class BanRules:
    """One engine's bans: its tokenizer (bad words' ids, kept per word) and its EOS ids."""

    def __init__(self, tokenizer, eos_token_ids: set[int]) -> None:
        self._tokenizer, self._eos = tokenizer, tuple(sorted(eos_token_ids))
        self._forms: dict[str, tuple[tuple[int, ...], ...]] = {}

    def of(self, params, token_ids: list[int], num_prompt_tokens: int) -> Bans | None:
        """The bans a request's `SamplingParams` ask of one sequence; None when none."""
        if not params.min_tokens and not params.bad_words and params.allowed_token_ids is None:
            return None
        forms = {f for word in params.bad_words for f in self._word_forms(word)}
        stop_ids = tuple(params.stop_token_ids) + (() if params.ignore_eos else self._eos)
        allowed = params.allowed_token_ids
        return Bans(token_ids, num_prompt_tokens, params.min_tokens, stop_ids,
                    tuple(sorted({f[0] for f in forms if len(f) == 1})),
                    tuple(sorted(f for f in forms if len(f) > 1)),
                    None if allowed is None else torch.tensor(sorted(set(allowed)), dtype=torch.int64))

    def _word_forms(self, word: str) -> tuple[tuple[int, ...], ...]:
        if word not in self._forms:
            if len(self._forms) >= MAX_WORDS_KEPT:  # a bound on what clients' words keep
                self._forms.clear()
            bare = word.lstrip()
            forms = {tuple(self._tokenizer.encode(text, add_special_tokens=False)) for text in (bare, " " + bare)}
            self._forms[word] = tuple(f for f in forms if f)
        return self._forms[word]


def ban_(out: torch.Tensor, rows: list[Bans | None]) -> torch.Tensor:
    """`out` [B, V] with each row's banned tokens at -inf, in place, in one write."""
    at, ids = [], []
    for j, bans in enumerate(rows):
        if bans is not None:
            banned = bans.now()
            at += [j] * len(banned)
            ids += banned
    if ids:
        out.index_put_((to_device(out.device, at), to_device(out.device, ids)),
                       torch.tensor(float("-inf"), dtype=out.dtype, device=out.device))
    for j, bans in enumerate(rows):
        if bans is not None and bans.allowed is not None:  # the rest of the row goes
            if bans.allowed.device != out.device:  # moved once, kept there
                bans.allowed = to_device(out.device, bans.allowed)
            allowed = bans.allowed
            kept = out[j, allowed]
            out[j] = float("-inf")
            out[j, allowed] = kept
    return out

"""Logprobs in OpenAI's shapes: a choice's tokens and their likeliest alternatives, as
completions write them (`tokens`, `token_logprobs`, `top_logprobs` keyed by text,
`text_offset`) or as chat does (`content` entries with `token`, `logprob`, `bytes`).

vLLM's `return_tokens_as_token_ids` labels each token `token_id:<id>` instead of its text,
so that a token whose text is not whole (a piece of a multi-byte character) can still be
told apart; offsets and bytes stay the text's.
"""

from __future__ import annotations

import itertools


class ChoiceLogprobs:
    """Logprobs of one request's choices in OpenAI's completions or chat shape. A
    completions token's `text_offset` is where its text starts in the choice's text: the
    lengths of the texts of the choice's tokens before it, in this chunk and the earlier
    ones (as vLLM counts it)."""

    def __init__(self, token_text, chat: bool, as_ids: bool = False) -> None:
        self.token_text, self.chat = token_text, chat
        self.label = (lambda token_id: f"token_id:{token_id}") if as_ids else token_text
        self._offset: dict[int, int] = {}  # choice index -> its text's length so far

    def render(self, entries, index: int = 0) -> dict | None:
        if not entries:
            return None
        if self.chat:
            def one(token_id, logprob):
                return {"token": self.label(token_id), "logprob": logprob,
                        "bytes": list(self.token_text(token_id).encode())}
            return {"content": [{**one(e.token_id, e.logprob),
                                 "top_logprobs": [one(t.token_id, t.logprob) for t in e.top]}
                                for e in entries]}
        texts = [self.token_text(e.token_id) for e in entries]
        offsets = list(itertools.accumulate(map(len, texts), initial=self._offset.get(index, 0)))
        self._offset[index] = offsets.pop()
        return {"tokens": [self.label(e.token_id) for e in entries],
                "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [None if e.top is None else self._by_label(e.top) for e in entries],
                "text_offset": offsets}

    def _by_label(self, top) -> dict[str, float]:
        """OpenAI's completions shape keys alternatives by text: of two ids that decode to
        the same text, the likelier (listed first) keeps the entry."""
        out: dict[str, float] = {}
        for t in top:
            out.setdefault(self.label(t.token_id), t.logprob)
        return out

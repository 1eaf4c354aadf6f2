"""Incremental detokenization and stop-string search.

`IncrementalDetokenizer` turns a growing list of token ids into text deltas. Invariants:
- It never emits part of a multi-byte character. Byte-level BPE tokens may end inside a
  UTF-8 sequence; such a decode ends in U+FFFD, and that text is held back until a later
  token completes it (or `flush()` gives it up at the end).
- Cost per `add` is a decode of a short trailing window, not of the whole sequence. The
  window starts at the last point where emitted text ended on a complete character
  (`_prefix_offset`); decoding the window and the already-emitted part of it
  (`_prefix_text`) and taking the difference yields exactly the new text, including the
  leading space that decoders such as SentencePiece's would drop at a sequence start.
- For byte-level tokenizers, the concatenation of every `add` result and `flush()` equals
  `tokenizer.decode(all_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`.
  Clean-up of tokenization spaces is never applied: it rewrites text already streamed.
"""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens kept as left context for the first output tokens; a few are enough for
# decoders whose output for a token depends on its neighbours (leading-space handling).
_PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True, prompt_token_ids=None):
        """`prompt_token_ids` (optional) gives left context so the first output token is
        decoded as a continuation of the prompt; the prompt's text itself is never emitted."""
        self.skip_special_tokens = skip_special_tokens
        # The Rust tokenizer decodes without transformers' per-call overhead.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            self._decode_fn = lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
        else:
            self._decode_fn = lambda ids: tokenizer.decode(
                ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
            )
        context = list(prompt_token_ids or [])[-_PROMPT_CONTEXT_TOKENS:]
        # The window: token ids from the last safe cut on. Ids before it are dropped.
        self._window: list[int] = context
        self._read_offset = len(context)  # window[:read_offset] is already emitted
        self._prefix_text = self._decode(context)

    def _decode(self, ids: list[int]) -> str:
        return self._decode_fn(ids) if ids else ""

    def add(self, token_ids: list[int]) -> str:
        """Append `token_ids` and return the text that became complete (may be "")."""
        if not token_ids:
            return ""
        self._window.extend(token_ids)
        text = self._decode(self._window)
        if text.endswith(REPLACEMENT_CHAR) or len(text) < len(self._prefix_text):
            return ""  # an unfinished character: wait for the tokens that complete it
        # Emitting even "" (tokens with no visible text, such as skipped special tokens)
        # moves the window on, so it cannot grow without bound.
        return self._emit(text)

    def flush(self) -> str:
        """Text still held back (an incomplete character at the very end), for when the
        sequence finished. Its undecodable bytes come out as U+FFFD."""
        text = self._decode(self._window)
        return self._emit(text) if len(text) > len(self._prefix_text) else ""

    def _emit(self, text: str) -> str:
        new_text = text[len(self._prefix_text) :]
        # The next window starts where this emission's window's emitted part began to end
        # on a character boundary: everything after the old read offset.
        self._window = self._window[self._read_offset :]
        self._read_offset = len(self._window)
        self._prefix_text = self._decode(self._window)
        return new_text


def find_stop(text: str, stop: list[str], start: int = 0) -> int | None:
    """The index at which `text` must be cut because a stop string begins there, or None.

    Only matches that end at or after `start` are found: text before `start` was already
    searched when it arrived, so a match can begin at most `len(s) - 1` characters earlier.
    The earliest match among all stop strings wins.
    """
    best = None
    for s in stop:
        if not s:
            continue
        i = text.find(s, max(0, start - len(s) + 1))
        if i != -1 and (best is None or i < best):
            best = i
    return best

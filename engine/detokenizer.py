"""Incremental detokenization and stop-string search.

`detokenizer_factory(tokenizer)` makes one detokenizer per sequence; each turns a growing
list of token ids into text deltas:
- `ByteLevelDetokenizer`, for byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM): a token's
  text is a fixed byte string, so a delta is the new tokens' bytes through an incremental
  UTF-8 decoder, which holds back an unfinished character. No tokenizer call per token
  (the window's decodes were a quarter of a batch-256 step's host time, docs/benchmarks.md).
- `IncrementalDetokenizer`, for any other decoder (SentencePiece's, say). Cost per `add`
  is a decode of a short trailing window, not of the whole sequence. The window starts at
  the last point where emitted text ended on a complete character (`_read_offset`);
  decoding the window and the already-emitted part of it (`_prefix_text`) and taking the
  difference yields exactly the new text, including the leading space that decoders such
  as SentencePiece's would drop at a sequence start.
Invariants of both:
- It never emits part of a multi-byte character. Byte-level BPE tokens may end inside a
  UTF-8 sequence; that character is held back until a later token completes it (or
  `flush()` gives it up at the end, as U+FFFD).
- For byte-level tokenizers, the concatenation of every `add` result and `flush()` equals
  `tokenizer.decode(all_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`.
  Clean-up of tokenization spaces is never applied: it rewrites text already streamed.
"""

from __future__ import annotations

import codecs

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens kept as left context for the first output tokens; a few are enough for
# decoders whose output for a token depends on its neighbours (leading-space handling).
_PROMPT_CONTEXT_TOKENS = 6


def detokenizer_factory(tokenizer, skip_special_tokens: bool = True):
    """`make(prompt_token_ids, skip_special_tokens)` -> a new sequence's detokenizer, which
    leaves special tokens out of the text unless told otherwise. Each byte table is built
    once (a few tens of milliseconds for a 50k vocabulary): the default's here, the other's
    when a request first asks for it."""
    tables = {skip_special_tokens: byte_level_table(tokenizer, skip_special_tokens)}

    def make(prompt_token_ids=None, skip: bool = skip_special_tokens):
        if skip not in tables:
            tables[skip] = byte_level_table(tokenizer, skip)
        if tables[skip] is not None:
            return ByteLevelDetokenizer(tables[skip])
        return IncrementalDetokenizer(tokenizer, skip, prompt_token_ids)
    return make


class ByteLevelDetokenizer:
    """A byte-level tokenizer's text is the concatenation of its tokens' bytes, decoded
    with invalid bytes replaced (as tokenizers' ByteLevel decoder does), so no prompt
    context is needed and a character split over tokens waits in the UTF-8 decoder."""

    __slots__ = ("_table", "_utf8")

    def __init__(self, table: list[bytes]):
        self._table = table
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, token_ids: list[int]) -> str:
        table = self._table
        if len(token_ids) == 1 and token_ids[0] < len(table):  # a decode step's case
            return self._utf8.decode(table[token_ids[0]])
        # An id past the tokenizer's vocabulary (a model's padded rows) decodes to nothing.
        return self._utf8.decode(b"".join(table[i] if i < len(table) else b"" for i in token_ids))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


def _byte_level_map() -> dict[int, int]:
    """str.translate table: a byte-level character -> its byte; any other character below
    256 -> one above 255, so that encoding the result as latin-1 fails for a token holding
    a character outside the byte alphabet (GPT-2's `bytes_to_unicode`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    mapping = {c: 0xFFFF for c in others}
    mapping.update({b: b for b in printable})
    mapping.update({256 + n: b for n, b in enumerate(others)})
    return mapping


def byte_level_table(tokenizer, skip_special_tokens: bool) -> list[bytes] | None:
    """Each token id's bytes as tokenizers' ByteLevel decoder yields them, or None when
    the tokenizer's decoder is another one. A token with a character outside the byte
    alphabet (an added token such as "<think> ") is its UTF-8, as in that decoder; a
    skipped special token or an id without a token is b""."""
    from tokenizers import decoders

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.decoder) is not decoders.ByteLevel:
        return None
    added = backend.get_added_tokens_decoder()
    skipped = {i for i, t in added.items() if t.special} if skip_special_tokens else set()
    size = max([*backend.get_vocab(with_added_tokens=True).values(), *added, -1]) + 1
    to_bytes = _byte_level_map()
    table = [b""] * size
    for i in range(size):
        token = backend.id_to_token(i)
        if token is None or i in skipped:
            continue
        try:
            table[i] = token.translate(to_bytes).encode("latin-1")
        except UnicodeEncodeError:
            table[i] = token.encode()
    return table


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

"""Incremental detokenization never splits a character and adds up to a full decode."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from pdserve.engine.checkpoint import write_tokenizer
from pdserve.engine.detokenizer import IncrementalDetokenizer, find_stop

VOCAB = 512

# Characters of 1 to 4 UTF-8 bytes, so byte-level tokens often end mid-character.
ALPHABET = list("abc xyz.,!") + list("éüß東京数据模型日本語한국어") + ["🚀", "🙂", "✓", "€", "Ω"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d, vocab_size=VOCAB)
    return AutoTokenizer.from_pretrained(str(d))


def _chunked(ids: list[int], sizes: list[int]) -> list[list[int]]:
    chunks, i = [], 0
    for n in sizes:
        if i >= len(ids):
            break
        chunks.append(ids[i : i + n])
        i += n
    if i < len(ids):
        chunks.append(ids[i:])
    return chunks


def _stream(tok, chunks, skip_special_tokens=True) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    pieces = [detok.add(c) for c in chunks]
    return pieces, detok.flush()


SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@SETTINGS
@given(
    ids=st.lists(st.integers(0, VOCAB - 1), max_size=60),
    sizes=st.lists(st.integers(1, 4), max_size=60),
    skip=st.booleans(),
)
def test_streamed_text_of_any_token_sequence_adds_up_to_full_decode(tokenizer, ids, sizes, skip):
    pieces, rest = _stream(tokenizer, _chunked(ids, sizes), skip_special_tokens=skip)
    expected = tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    assert "".join(pieces) + rest == expected
    # Held-back text is only ever an unfinished character at the end.
    assert rest == "" or rest.endswith("\ufffd")


@SETTINGS
@given(text=st.text(alphabet=ALPHABET, max_size=80), sizes=st.lists(st.integers(1, 3), max_size=80))
def test_streaming_valid_text_never_emits_a_split_character(tokenizer, text, sizes):
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, rest = _stream(tokenizer, _chunked(ids, sizes))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text
    assert rest == ""


def test_emoji_split_over_tokens_comes_out_whole(tokenizer):
    ids = tokenizer.encode("a 🚀 b", add_special_tokens=False)
    assert IncrementalDetokenizer(tokenizer).add([]) == ""
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add([i]) for i in ids]
    assert any(p == "" for p in pieces), "the test needs an emoji that spans tokens"
    assert "".join(pieces) == "a 🚀 b"
    assert any("🚀" in p for p in pieces)


def test_special_tokens_are_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("hi", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert "".join(IncrementalDetokenizer(tokenizer).add([i]) for i in ids) == "hi"
    kept = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(kept.add([i]) for i in ids) == "hi<|eos|>"


def test_prompt_context_is_not_emitted(tokenizer):
    prompt = tokenizer.encode("the model", add_special_tokens=False)
    out = tokenizer.encode(" serves 東京", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt)
    assert "".join(detok.add([i]) for i in out) == " serves 東京"


class _CountingTokenizer:
    """Wraps a tokenizer's decode to record how many ids each call decodes."""

    def __init__(self, tok):
        self._tok = tok
        self.lengths: list[int] = []

    def decode(self, ids, **kw):
        self.lengths.append(len(ids))
        return self._tok.decode(ids, **kw)


def test_each_add_decodes_only_a_short_window(tokenizer):
    counting = _CountingTokenizer(tokenizer)
    text = " ".join(["the quick brown fox 東京 🚀 jumps over the lazy dog"] * 40)
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(counting)
    out = "".join(detok.add([i]) for i in ids)
    assert out == text
    assert len(ids) > 400
    assert max(counting.lengths) <= 8


def test_invisible_tokens_do_not_grow_the_window(tokenizer):
    counting = _CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting)
    out = "".join(detok.add([tokenizer.eos_token_id]) for _ in range(300))
    out += detok.add(tokenizer.encode("ok", add_special_tokens=False))
    assert out == "ok"
    assert max(counting.lengths) <= 4


def test_find_stop_returns_earliest_match():
    assert find_stop("hello world. bye", ["bye", "."]) == 11
    assert find_stop("hello", ["xyz"]) is None
    assert find_stop("hello", []) is None
    assert find_stop("hello", [""]) is None


def test_find_stop_searches_only_matches_reaching_new_text():
    text = "stop here, then more STOP"
    # "stop" lies entirely before start=10: already searched, not found again.
    assert find_stop(text, ["stop"], start=10) is None
    # A match that straddles the boundary is found.
    assert find_stop("abcSTOP", ["STOP"], start=5) == 3
    assert find_stop("abcSTOP", ["STOP"], start=6) == 3
    assert find_stop("abcSTOP", ["STOP"], start=7) is None

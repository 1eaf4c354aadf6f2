"""Incremental detokenization never splits a character and adds up to a full decode, in
both kinds: the byte table of a byte-level tokenizer and tokenizers' own decode of a
window; a byte-level tokenizer gets the table, any other the window."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.checkpoint import write_tokenizer
from pdserve.engine.detokenizer import (
    ByteLevelDetokenizer,
    IncrementalDetokenizer,
    byte_level_table,
    detokenizer_factory,
    find_stop,
)

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


KINDS = {"byte-level": lambda tok, skip, prompt=None: detokenizer_factory(tok, skip)(prompt),
         "window": lambda tok, skip, prompt=None: IncrementalDetokenizer(tok, skip, prompt)}


@pytest.fixture(params=list(KINDS))
def make(request):
    """(tokenizer, skip_special_tokens, prompt_token_ids=None) -> a detokenizer of one kind."""
    return KINDS[request.param]


def _stream(make, tok, chunks, skip_special_tokens=True) -> tuple[list[str], str]:
    detok = make(tok, skip_special_tokens)
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
def test_streamed_text_of_any_token_sequence_adds_up_to_full_decode(make, tokenizer, ids, sizes, skip):
    pieces, rest = _stream(make, tokenizer, _chunked(ids, sizes), skip_special_tokens=skip)
    expected = tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    assert "".join(pieces) + rest == expected
    # Held-back text is only ever an unfinished character at the end.
    assert rest == "" or rest.endswith("\ufffd")


@SETTINGS
@given(text=st.text(alphabet=ALPHABET, max_size=80), sizes=st.lists(st.integers(1, 3), max_size=80))
def test_streaming_valid_text_never_emits_a_split_character(make, tokenizer, text, sizes):
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, rest = _stream(make, tokenizer, _chunked(ids, sizes))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text
    assert rest == ""


def test_emoji_split_over_tokens_comes_out_whole(make, tokenizer):
    ids = tokenizer.encode("a 🚀 b", add_special_tokens=False)
    assert make(tokenizer, True).add([]) == ""
    detok = make(tokenizer, True)
    assert any(tokenizer.decode([i]).endswith("\ufffd") for i in ids), "the test needs an emoji that spans tokens"
    pieces = [detok.add([i]) for i in ids]
    assert "".join(pieces) == "a 🚀 b"
    assert any("🚀" in p for p in pieces)


def test_special_tokens_are_skipped_or_kept(make, tokenizer):
    ids = tokenizer.encode("hi", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert "".join(make(tokenizer, True).add([i]) for i in ids) == "hi"
    kept = make(tokenizer, False)
    assert "".join(kept.add([i]) for i in ids) == "hi<|eos|>"


def test_prompt_context_is_not_emitted(make, tokenizer):
    prompt = tokenizer.encode("the model", add_special_tokens=False)
    out = tokenizer.encode(" serves 東京", add_special_tokens=False)
    detok = make(tokenizer, True, prompt)
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


def test_a_character_cut_off_at_the_end_is_flushed_as_a_replacement(make, tokenizer):
    ids = tokenizer.encode("ok 東", add_special_tokens=False)
    detok = make(tokenizer, True)
    cut = [i for i in ids if tokenizer.decode([i]).endswith("\ufffd")][:1]  # the lead bytes of 東
    assert cut, "the test needs a character split over tokens"
    head = ids[:ids.index(cut[0]) + 1]
    text = "".join(detok.add([i]) for i in head)
    rest = detok.flush()
    assert "\ufffd" not in text and rest.endswith("\ufffd")
    assert text + rest == tokenizer.decode(head) and detok.flush() == ""


def test_the_byte_table_is_tokenizers_decode_of_every_id(tmp_path):
    write_tokenizer(tmp_path, vocab_size=VOCAB)  # its own: the module's is not to be changed
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    # Added tokens: special (skipped or kept) and plain, one with characters outside the
    # byte alphabet (a space, CJK), which the ByteLevel decoder passes as UTF-8.
    tokenizer.add_tokens(["<think> ", "東京駅"])
    backend, size = tokenizer.backend_tokenizer, len(tokenizer)
    for skip in (True, False):
        table = byte_level_table(tokenizer, skip)
        assert len(table) == size
        for i in range(size):
            want = backend.decode([i], skip_special_tokens=skip).encode()
            assert table[i].decode("utf-8", "replace").encode() == want, (i, table[i], want)
    assert "".join(detokenizer_factory(tokenizer)().add([i]) for i in (size - 2, size - 1, size + 5)) == \
        "<think> 東京駅"  # an id past the vocabulary (a model's padded rows) is no text


def test_a_byte_level_tokenizer_gets_the_table_and_another_the_window(tokenizer):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    assert isinstance(detokenizer_factory(tokenizer)(), ByteLevelDetokenizer)
    vocab = {"<unk>": 0, "▁the": 1, "▁model": 2, "s": 3}
    metaspace = Tokenizer(models.WordPiece(vocab, unk_token="<unk>"))
    metaspace.pre_tokenizer, metaspace.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    other = PreTrainedTokenizerFast(tokenizer_object=metaspace, unk_token="<unk>")
    assert byte_level_table(other, True) is None
    detok = detokenizer_factory(other)([1])
    assert isinstance(detok, IncrementalDetokenizer)
    assert "".join(detok.add([i]) for i in (2, 3)) == " models"


def test_the_engine_streams_the_decode_of_its_tokens(checkpoint_dirs):
    # Temperature 5 picks nearly uniform tokens: byte tokens that split and break
    # characters, special tokens, merges; the text streamed must still be their decode.
    llm = LLM(checkpoint_dirs("llama"))
    params = SamplingParams(max_tokens=48, temperature=5.0, seed=1, ignore_eos=True)
    outs = llm.generate([[5, 6, 7], [40, 41]], params)
    for out in outs:
        ids = out.outputs[0].token_ids
        assert out.outputs[0].text == llm.tokenizer.decode(ids, skip_special_tokens=True,
                                                           clean_up_tokenization_spaces=False)
    assert isinstance(llm.engine.new_detokenizer(), ByteLevelDetokenizer)


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

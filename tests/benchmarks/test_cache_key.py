"""`pdserve bench cache-key`: its shares, medians and ratio, and one smoke run of the whole
bench on a random tiny model (two routers, two prefill and two decode processes). What the
key buys in time is measured by the bench, not asserted here; that the routers agree on a
key's nodes is asserted, as it does not depend on timing."""

from __future__ import annotations

import json

import pytest

from pdserve.benchmarks import cache_key as bench


def _turn(ttft, prompt_tokens, cached, decode):
    return {"ttft_s": ttft, "prompt_tokens": prompt_tokens, "decode_cached": cached, "decode": decode}


def test_summary_counts_the_later_turns_of_each_mode():
    unkeyed = [[[_turn(1, 10, 0, "a"), _turn(4, 20, 0, "b"), _turn(2, 30, 16, "a")]]]
    keyed = [[[_turn(1, 10, 0, "a"), _turn(1, 20, 8, "a"), _turn(3, 30, 24, "a")]]]
    out = bench.summary({"unkeyed": unkeyed, "keyed": keyed})
    assert out["unkeyed_decode_cached_share"] == pytest.approx(16 / 50)
    assert out["keyed_decode_cached_share"] == pytest.approx(32 / 50)
    assert (out["unkeyed_same_decode_share"], out["keyed_same_decode_share"]) == (0.5, 1.0)
    assert (out["unkeyed_later_turn_ttft_s"], out["keyed_later_turn_ttft_s"]) == (3, 2)
    assert out["ttft_ratio"] == pytest.approx(2 / 3) and out["keyed_first_turn_ttft_s"] == 1


def test_a_smoke_run_keeps_each_keyed_conversation_on_one_decode_node(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    out = tmp_path / "cache-key.json"
    assert bench.main(["--model", "bench-random-tiny", "--conversations", "2", "--turns", "3", "--rounds", "1",
                       "--system-words", "40", "--question-words", "4", "--max-tokens", "2",
                       "--json", "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == json.loads(out.read_text())
    assert report["model"]["name"] == "bench-random-tiny" and report["routers"] == 2
    assert report["keyed_same_decode_share"] == 1.0  # both routers send a key to one node
    assert report["keyed_decode_cached_share"] > 0.5  # ... which holds the turns before
    assert report["ttft_ratio"] > 0

"""The disaggregation primitives: a prefill-only request's KV, copied by plain tensor
indexing into slots reserved with prepare_receive, generates exactly what an ordinary
request generates, and for every family what transformers generates; reservations and
pinned prefills free their pages when let go."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import OutOfPages, SamplingParams, UnknownRequest
from pdserve.engine.checkpoint import FAMILIES

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def run_to_end(engine, request_id):
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                final = out
    return final


def kv_at(engine, slots):
    """Index of the K and V of `slots` in every layer of the page-major kv_cache
    [pages, layers, 2, page_size, Hkv, D]; selects [len(slots), layers, 2, Hkv, D]."""
    s = torch.tensor(slots, dtype=torch.int64)
    return s // engine.page_size, slice(None), slice(None), s % engine.page_size


def copy_kv(src, src_slots, dst, dst_slots):
    dst.kv_cache[kv_at(dst, dst_slots)] = src.kv_cache[kv_at(src, src_slots)]


@pytest.mark.parametrize(("family", "p_page", "d_page", "end_from_back"), [
    ("llama", 4, 4, 1), ("qwen2", 16, 5, 3), ("qwen3", 1, 7, 1), ("llama3", 5, 16, 6),
])
def test_received_kv_generates_like_a_local_request(family, p_page, d_page, end_from_back, make_engine, prompts_of_lengths):
    prefill = make_engine(family, page_size=p_page, num_pages=512 // p_page)
    decode = make_engine(family, page_size=d_page, num_pages=512 // d_page)
    prompt = prompts_of_lengths([27], seed=21)[0]
    end = len(prompt) - end_from_back

    decode.add_request("local", prompt, GREEDY)
    expected = run_to_end(decode, "local").token_ids

    res = decode.prepare_receive("r", prompt, GREEDY, kv_window_end=end)
    # The local run put the prompt's full pages into D's prefix cache.
    assert res.prefix_matched_length == ((end - 1) // d_page) * d_page
    assert res.kv_window_end == end and len(res.slots) == end - res.prefix_matched_length

    prefill.add_request("r", prompt[:end], GREEDY, prefill_only=True)
    done = run_to_end(prefill, "r")
    assert done.finished and done.finish_reason == "prefilled" and done.token_ids == []
    slots = prefill.slots_of("r")
    assert len(slots) == end and done.slots == slots  # the output names them: no second call
    copy_kv(prefill, slots[res.prefix_matched_length:], decode, res.slots)
    assert prefill.release("r")

    decode.start_generation("r")
    out = run_to_end(decode, "r")
    assert out.token_ids == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_prefilled_on_one_engine_decodes_on_another_as_transformers(family, make_engine, hf_greedy,
                                                                                  prompts_of_lengths):
    # Pages of 4 on P and 5 on D; the decode engine prefills the prompt's last 3 tokens (a
    # KV window ending before the prompt does), past the 8-token windows of the families
    # that have them.
    prefill, decode = make_engine(family, page_size=4, num_pages=32), make_engine(family, page_size=5, num_pages=32)
    prompt = prompts_of_lengths([29], seed=22)[0]
    end = len(prompt) - 3
    res = decode.prepare_receive("r", prompt, GREEDY, kv_window_end=end)
    prefill.add_request("r", prompt[:end], GREEDY, prefill_only=True)
    slots = run_to_end(prefill, "r").slots
    copy_kv(prefill, slots[res.prefix_matched_length:], decode, res.slots)
    assert prefill.release("r")
    decode.start_generation("r")
    assert run_to_end(decode, "r").token_ids == hf_greedy(family, prompt, GREEDY.max_tokens)


def test_received_kv_is_what_decode_uses(make_engine, prompts_of_lengths):
    """Garbage in the received slots changes the output: the test above could fail."""
    decode = make_engine("llama", page_size=4, num_pages=128, enable_prefix_cache=False)
    prompt = prompts_of_lengths([20], seed=22)[0]
    decode.add_request("local", prompt, GREEDY)
    expected = run_to_end(decode, "local").token_ids
    res = decode.prepare_receive("r", prompt, GREEDY, kv_window_end=19)
    assert res.prefix_matched_length == 0
    decode.kv_cache[kv_at(decode, res.slots)] = 3.0
    decode.start_generation("r")
    assert run_to_end(decode, "r").token_ids != expected


def test_n_samples_after_start_generation(make_engine, prompts_of_lengths):
    prefill = make_engine("llama", page_size=4, num_pages=128)
    decode = make_engine("llama", page_size=4, num_pages=128)
    prompt = prompts_of_lengths([18], seed=23)[0]
    params = SamplingParams(max_tokens=6, temperature=1.0, n=3, seed=5)
    decode.add_request("local", prompt, params)
    expected = [o.token_ids for o in run_to_end(decode, "local").outputs]
    decode.prefix_cache.clear()
    res = decode.prepare_receive("r", prompt, params, kv_window_end=17)
    prefill.add_request("p", prompt[:17], params, prefill_only=True)
    run_to_end(prefill, "p")
    copy_kv(prefill, prefill.slots_of("p"), decode, res.slots)
    prefill.release("p")
    decode.start_generation("r")
    assert [o.token_ids for o in run_to_end(decode, "r").outputs] == expected


def test_abort_of_parked_reservation_frees_its_pages(make_engine, prompts_of_lengths):
    decode = make_engine("llama", page_size=4, num_pages=32)
    prompt = prompts_of_lengths([30], seed=24)[0]
    decode.prepare_receive("r", prompt, GREEDY, kv_window_end=29)
    assert decode.num_free_pages() == 32 - 8
    assert not decode.has_unfinished()  # parked requests are not scheduled
    decode.step()
    assert decode.num_free_pages() == 32 - 8
    assert decode.abort("r")
    assert decode.num_free_pages() == 32
    assert not decode.abort("r")
    with pytest.raises(UnknownRequest):
        decode.start_generation("r")


def test_prepare_receive_without_room_raises_and_holds_nothing(make_engine, prompts_of_lengths):
    decode = make_engine("llama", page_size=4, num_pages=10)
    prompt = prompts_of_lengths([30], seed=25)[0]
    decode.prepare_receive("a", prompt, GREEDY, kv_window_end=29)  # 8 pages
    with pytest.raises(OutOfPages):
        decode.prepare_receive("b", prompt[::-1], GREEDY, kv_window_end=29)
    assert decode.num_free_pages() == 2
    with pytest.raises(ValueError, match="kv_window_end"):
        decode.prepare_receive("c", prompt, GREEDY, kv_window_end=30)
    decode.abort("a")


def test_prefill_only_pins_pages_until_release_and_abort_frees_them(make_engine, prompts_of_lengths):
    prefill = make_engine("qwen2", page_size=4, num_pages=64)
    p1, p2 = prompts_of_lengths([10, 13], seed=26)
    prefill.add_request("a", p1, GREEDY, prefill_only=True)
    prefill.add_request("b", p2, GREEDY, prefill_only=True)
    seen = []
    prefill.layer_hook = lambda layer, ranges: seen.append((layer, ranges))
    while prefill.has_unfinished():
        prefill.step()
    assert prefill.num_free_pages() == 64 - 3 - 4
    assert {r[:3] for _, ranges in seen for r in ranges} == {("a", 0, 10), ("b", 0, 13)}
    assert all(slots.tolist() == prefill.slots_of(rid)[b:e] for _, ranges in seen for rid, b, e, slots in ranges)
    assert sorted({layer for layer, _ in seen}) == [0, 1]
    assert len(set(prefill.slots_of("b"))) == 13
    assert prefill.release("a") and prefill.abort("b")
    with pytest.raises(UnknownRequest):
        prefill.slots_of("a")


def test_on_a_gpu_pages_go_to_a_remote_writer_only_after_the_stores_queued_on_them(make_engine, monkeypatch,
                                                                                   prompts_of_lengths):
    # A step that samples nothing (a prefill chunk) returns with its KV stores queued on
    # the device; sampling waits for a step. Pages an abort freed meanwhile may be the next
    # reservation's, which a prefill node's copies fill unordered with this stream: the
    # reservation waits for the stream first. The CPU engine runs as if on a GPU here, with
    # a stand-in stream that counts the waits.
    engine = make_engine("llama", page_size=4, num_pages=64, max_num_batched_tokens=8)
    waits = []

    class Stream:
        def synchronize(self):
            waits.append("wait")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    engine.runner.on_gpu = True
    prompt = prompts_of_lengths([30], seed=3)[0]
    engine.add_request("chunked", prompt, GREEDY)
    engine.step()  # its first 8 tokens: nothing sampled
    assert engine.abort("chunked")
    engine.prepare_receive("r1", prompt, GREEDY, kv_window_end=20)
    assert waits == ["wait"]  # once, before handing out pages
    engine.prepare_receive("r2", prompt, GREEDY, kv_window_end=20)
    assert waits == ["wait"]  # nothing queued since
    engine.add_request("short", prompt[:5], GREEDY)
    engine.step()  # prefills and samples: the sample waited for the step
    engine.prepare_receive("r3", prompt, GREEDY, kv_window_end=20)
    assert waits == ["wait"]
    for rid in ("r1", "r2", "r3", "short"):
        engine.abort(rid)


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_the_slots_of_any_range_are_each_positions_page_and_offset(page_size):
    from pdserve.engine.sequence import Sequence

    g = torch.Generator().manual_seed(page_size)
    pages = torch.randperm(500, generator=g)[:40].tolist()
    seq = Sequence(None, 0, list(range(40 * page_size)), 40 * page_size, pages=pages)
    every = [pages[i // page_size] * page_size + i % page_size for i in range(40 * page_size)]
    for begin, end in [(0, 40 * page_size), (0, 1), (page_size, 2 * page_size + 1), (5, 5),
                       (40 * page_size - 1, 40 * page_size), (page_size + 1, 30 * page_size - 2)]:
        assert seq.slots(begin, end, page_size) == every[begin:end]
        assert seq.slot_array(begin, end, page_size).tolist() == every[begin:end]

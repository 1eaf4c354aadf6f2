"""A decode node's `max_num_seqs` (engine/scheduler.py): requests whose prompt KV arrived
run at most that many at once, the rest holding their pages until a slot frees, in order
of priority; each still answers exactly transformers' greedy output, and one aborted
while it waits gives its pages back."""

from __future__ import annotations

import pytest

from pdserve.engine import SamplingParams
from tests.engine.test_disaggregation import copy_kv
from tests.engine.test_priority_preemption import run

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture
def engines(make_engine):
    prefill = make_engine("llama", page_size=4, num_pages=128)
    decode = make_engine("llama", page_size=4, num_pages=64, enable_prefix_cache=False, max_num_seqs=2)
    return prefill, decode


def receive(prefill, decode, request_id, prompt, priority=0):
    """What the decode node's gRPC service does for one request: reserve, take the KV of
    all but the last prompt token from the prefill engine, start generating."""
    end = len(prompt) - 1
    reservation = decode.prepare_receive(request_id, prompt, GREEDY, kv_window_end=end, priority=priority)
    prefill.add_request(request_id, prompt[:end], GREEDY, prefill_only=True)
    run(prefill)
    copy_kv(prefill, prefill.slots_of(request_id), decode, reservation.slots)
    prefill.release(request_id)
    decode.start_generation(request_id)


def test_started_requests_run_at_most_max_num_seqs_at_once(engines, hf_greedy, prompts_of_lengths):
    prefill, decode = engines
    prompts = prompts_of_lengths([9, 14, 6, 11, 17], seed=51)
    for i, prompt in enumerate(prompts):
        receive(prefill, decode, f"r{i}", prompt)
    done, most = {}, 0
    while decode.has_unfinished():
        done |= {o.request_id: o for o in decode.step() if o.finished}
        most = max(most, len(decode.scheduler.running))
    assert most == 2 and list(done)[:2] == ["r0", "r1"]  # first started, first run
    assert [done[f"r{i}"].token_ids for i in range(5)] == [hf_greedy("llama", p, 6) for p in prompts]
    assert decode.num_free_pages() == decode.num_total_pages()


@pytest.mark.parametrize(("priority", "displaces"), [(0, True), (5, False)])
def test_a_started_request_takes_a_slot_from_a_worse_priority_only(priority, displaces, engines, hf_greedy,
                                                                   prompts_of_lengths):
    prefill, decode = engines
    low_a, low_b, arriving = prompts_of_lengths([10, 12, 13], seed=52)
    decode.add_request("a", low_a, GREEDY, priority=5)
    decode.add_request("b", low_b, GREEDY, priority=5)
    assert run(decode, steps=2) == {}  # both slots taken, decoding
    receive(prefill, decode, "r", arriving, priority=priority)
    decode.step()
    running = [s.request.request_id for s in decode.scheduler.running]
    assert running == (["r", "a"] if displaces else ["a", "b"])
    assert decode.scheduler.num_preemptions == int(displaces)  # "b", ranked last, recomputes
    done = run(decode)
    assert [done[r].token_ids for r in "abr"] == [hf_greedy("llama", p, 6) for p in (low_a, low_b, arriving)]
    assert decode.num_free_pages() == decode.num_total_pages()


def test_a_request_aborted_while_it_waits_for_a_slot_gives_its_pages_back(engines, prompts_of_lengths):
    prefill, decode = engines
    for i, prompt in enumerate(prompts_of_lengths([9, 10, 11], seed=53)):
        receive(prefill, decode, f"r{i}", prompt)
    decode.step()
    assert [s.request.request_id for s in decode.scheduler.started] == ["r2"]
    held = decode.num_total_pages() - decode.num_free_pages()
    assert decode.abort("r2") and decode.num_total_pages() - decode.num_free_pages() == held - 3
    assert sorted(run(decode)) == ["r0", "r1"] and decode.num_free_pages() == decode.num_total_pages()


def test_a_running_request_short_of_pages_takes_them_from_one_waiting_for_a_slot(make_engine, hf_greedy,
                                                                                  prompts_of_lengths):
    # Six pages of 4: the three 8-token prompts' KV (7 positions) takes 2 each, and "r0"
    # needs a third for its second generated token.
    prefill = make_engine("llama", page_size=4, num_pages=128)
    decode = make_engine("llama", page_size=4, num_pages=6, enable_prefix_cache=False, max_num_seqs=1)
    prompts = prompts_of_lengths([8, 8, 8], seed=54)
    for i, prompt in enumerate(prompts):
        receive(prefill, decode, f"r{i}", prompt)
    assert decode.num_free_pages() == 0
    done = run(decode)
    assert list(done) == ["r0", "r1", "r2"]
    assert [done[f"r{i}"].token_ids for i in range(3)] == [hf_greedy("llama", p, 6) for p in prompts]
    assert decode.scheduler.num_preemptions == 1  # "r2" recomputed its KV; "r0" went on
    assert decode.num_free_pages() == decode.num_total_pages()

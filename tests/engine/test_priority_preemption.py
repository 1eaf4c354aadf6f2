"""Priority preemption (engine/scheduler.py): a request of a better priority takes the
sequence slot or the KV pages of running ones of a worse priority, which recompute their
KV later and still answer exactly transformers' greedy output; equal priorities never
displace each other; a decode node's reservation for arriving KV does the same."""

from __future__ import annotations

import pytest

from pdserve.engine import OutOfPages, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def run(engine, steps=None):
    """Step until idle (or `steps` times): {request id: final output}, in finishing order."""
    done = {}
    while engine.has_unfinished() and (steps is None or steps > 0):
        done |= {o.request_id: o for o in engine.step() if o.finished}
        steps = None if steps is None else steps - 1
    return done


def test_a_better_priority_takes_the_only_slot_and_the_displaced_request_still_answers_exactly(
        make_engine, hf_greedy, prompts_of_lengths):
    engine = make_engine("llama", page_size=4, num_pages=64, max_num_batched_tokens=16, max_num_seqs=1)
    low, high = prompts_of_lengths([10, 9], seed=41)
    engine.add_request("low", low, GREEDY, priority=5)
    assert run(engine, steps=3) == {}  # prefilled, a few tokens out
    engine.add_request("high", high, GREEDY, priority=0)
    done = run(engine)
    assert list(done) == ["high", "low"] and engine.scheduler.num_preemptions == 1
    assert done["low"].token_ids == hf_greedy("llama", low, 12)
    assert done["high"].token_ids == hf_greedy("llama", high, 12)


@pytest.mark.parametrize(("priority", "displaces"), [(-1, True), (3, False), (9, False)])
def test_pages_go_to_a_better_priority_only(priority, displaces, make_engine, hf_greedy, prompts_of_lengths):
    # 14 pages of 4: the two running requests grow to 6 pages each; the third's 14-token
    # prompt needs 4 more than the 2 left.
    engine = make_engine("llama", page_size=4, num_pages=14, max_num_batched_tokens=32)
    prompts = prompts_of_lengths([12, 12, 14], seed=42)
    expected = [hf_greedy("llama", p, 12) for p in prompts]
    assert all(len(e) == 12 for e in expected), "the pressure needs whole outputs"
    engine.add_request("a", prompts[0], GREEDY, priority=3)
    engine.add_request("b", prompts[1], GREEDY, priority=3)
    assert run(engine, steps=10) == {} and engine.num_free_pages() == 2
    engine.add_request("c", prompts[2], GREEDY, priority=priority)
    # at once, on "b"'s pages (ranked last; "a" goes on), or once "a" and "b" are done
    assert ("c" in {o.request_id for o in engine.step()}) is displaces
    assert engine.scheduler.running[0].request.request_id == ("c" if displaces else "a")
    done = run(engine)
    assert [done[r].token_ids for r in "abc"] == expected
    assert engine.scheduler.num_preemptions == int(displaces)


def test_a_decode_nodes_reservation_preempts_worse_running_requests_only(make_engine, hf_greedy, prompts_of_lengths):
    from tests.engine.test_disaggregation import copy_kv

    prefill = make_engine("llama", page_size=4, num_pages=64)
    decode = make_engine("llama", page_size=4, num_pages=12, enable_prefix_cache=False)
    running, arriving = prompts_of_lengths([16, 30], seed=43)
    decode.add_request("running", running, GREEDY, priority=2)
    run(decode, steps=6)
    held = decode.num_total_pages() - decode.num_free_pages()
    assert held >= 5  # the 8 pages of the arriving prompt's 29 positions are not free
    for priority in (2, 7):  # as good or worse: it waits in line, nothing is preempted
        with pytest.raises(OutOfPages):
            decode.prepare_receive("r", arriving, GREEDY, kv_window_end=29, priority=priority)
        assert decode.num_total_pages() - decode.num_free_pages() == held
    reservation = decode.prepare_receive("r", arriving, GREEDY, kv_window_end=29, priority=1)
    assert decode.scheduler.num_preemptions == 1 and len(reservation.slots) == 29

    prefill.add_request("r", arriving[:29], GREEDY, prefill_only=True)
    run(prefill)
    copy_kv(prefill, prefill.slots_of("r"), decode, reservation.slots)
    prefill.release("r")
    decode.start_generation("r")
    done = run(decode)
    assert done["r"].token_ids == hf_greedy("llama", arriving, 12)
    assert done["running"].token_ids == hf_greedy("llama", running, 12)  # recomputed, then on


def test_a_prefill_nodes_running_prefill_is_never_displaced(make_engine, prompts_of_lengths):
    """Its KV may be on its way to a decode node, layer by layer: it finishes first."""
    engine = make_engine("llama", page_size=4, num_pages=64, max_num_batched_tokens=8, max_num_seqs=1)
    low, high = prompts_of_lengths([30, 9], seed=44)
    engine.add_request("low", low, GREEDY, prefill_only=True, priority=5)
    assert run(engine, steps=1) == {}  # its first chunk of 8
    engine.add_request("high", high, GREEDY, prefill_only=True, priority=0)
    done = run(engine)
    assert list(done) == ["low", "high"] and engine.scheduler.num_preemptions == 0
    for request_id in done:
        engine.release(request_id)

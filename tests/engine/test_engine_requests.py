"""Request validation, abort, the step token budget and running out of room."""

from __future__ import annotations

import pytest

from pdserve.engine import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.fixture
def engine(make_engine):
    return make_engine("llama", page_size=4, num_pages=64, max_num_batched_tokens=16)


@pytest.mark.parametrize(("prompt", "message"), [
    ([], "empty"),
    ([1, 512], "512"),
    ([1, -1], "-1"),
    ([5] * 2048, "2048 tokens"),
])
def test_bad_prompts_are_rejected_with_the_value(engine, prompt, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request("x", prompt, GREEDY)
    assert not engine.has_unfinished()


@pytest.mark.parametrize(("params", "message"), [
    (SamplingParams(top_p=1.5), "top_p must be in \\(0, 1\\], got 1.5"),
    (SamplingParams(max_tokens=0), "max_tokens"),
    (SamplingParams(temperature=-1), "temperature"),
    (SamplingParams(n=0), "n must"),
    (SamplingParams(stop_token_ids=[600]), "stop_token_ids"),
    (SamplingParams(logprobs=-2), "logprobs"),
    (SamplingParams(frequency_penalty=-2.5), "frequency_penalty must be in \\[-2, 2\\], got -2.5"),
    (SamplingParams(presence_penalty=float("nan")), "presence_penalty must be in"),
    (SamplingParams(repetition_penalty=float("inf")), "repetition_penalty must be > 0"),
    (SamplingParams(logit_bias={512: 1.0}), "logit_bias must be keyed by token ids in \\[0, 512\\), got 512"),
    (SamplingParams(logit_bias={"7": 1.0}), "logit_bias must be keyed by token ids"),
    (SamplingParams(logit_bias={7: 100.5}), "logit_bias\\[7\\] must be in \\[-100, 100\\], got 100.5"),
    (SamplingParams(logit_bias=dict.fromkeys(range(1025), 1.0)), "at most 1024 token ids"),
])
def test_bad_sampling_params_are_rejected(engine, params, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request("x", [5, 6], params)


def test_duplicate_request_id_is_rejected(engine):
    engine.add_request("x", [5, 6], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", [5, 6], GREEDY)
    engine.abort("x")


def test_abort_frees_running_and_waiting_requests(engine, prompts_of_lengths):
    for i, p in enumerate(prompts_of_lengths([30, 30, 30], seed=31)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=50, temperature=0.0))
    engine.step()
    engine.step()
    assert engine.num_free_pages() < engine.num_total_pages()
    assert all(engine.abort(str(i)) for i in range(3))
    assert not engine.has_unfinished()


def test_each_step_respects_the_token_budget(engine, prompts_of_lengths):
    planned = []
    schedule = engine.scheduler.schedule

    def spy():
        batch = schedule()
        planned.append(sum(batch.num_new_tokens))
        return batch

    engine.scheduler.schedule = spy
    for i, p in enumerate(prompts_of_lengths([30, 3, 25], seed=32)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=5, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    assert max(planned) == 16  # prompts were chunked to fill the budget, never beyond
    assert sum(planned) == 30 + 3 + 25 + 3 * 4


def test_sequence_that_outgrows_the_whole_pool_finishes_with_length(make_engine, prompts_of_lengths):
    engine = make_engine("llama", page_size=4, num_pages=4)  # 16 slots in all
    engine.add_request("x", prompts_of_lengths([10], seed=33)[0], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out
    assert final.finished and final.finish_reason == "length"
    assert len(final.token_ids) == 16 - 10 + 1


def test_prompt_larger_than_the_pool_is_rejected(make_engine):
    engine = make_engine("llama", page_size=4, num_pages=4)
    with pytest.raises(ValueError, match="KV pages"):
        engine.add_request("x", [5] * 17, GREEDY)


def test_a_request_that_could_never_fit_names_its_prompt_and_max_tokens(make_engine):
    """What a decode node checks before a request waits in line for pages (the engine
    itself would end it with "length" when the pool ran out)."""
    engine = make_engine("llama", page_size=4, num_pages=4)  # 16 slots
    engine.capacity.check_fits(10, SamplingParams(max_tokens=7))  # 16 tokens of KV: fits
    with pytest.raises(ValueError, match=r"prompt of 10 tokens plus max_tokens 8 needs 5 KV "
                                         r"pages, more than the 4 of this engine \(16 tokens\)"):
        engine.capacity.check_fits(10, SamplingParams(max_tokens=8))
    engine.capacity.check_fits(16, SamplingParams(max_tokens=8), prefill_only=True)  # a prefill node's


def test_each_delta_holds_the_output_as_it_was_then(engine):
    # Deltas carry views of the sequence's ids and logprobs, not copies: one read after
    # the sequence grew must still give what it had at that step.
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2))
    deltas = []
    while engine.has_unfinished():
        deltas += [o.outputs[0] for o in engine.step() if o.request_id == "r"]
    final = deltas[-1]
    assert final.finish_reason == "length" and type(final.token_ids) is list and len(final.token_ids) == 6
    seen = 0
    for d in deltas:
        seen += len(d.new_token_ids)
        assert len(d.token_ids) == len(d.logprobs) == seen
        assert d.token_ids == final.token_ids[:seen] and list(d.token_ids[-1:]) == final.token_ids[seen - 1:seen]
        assert [s.token_id for s in d.logprobs] == final.token_ids[:seen]
    assert seen == 6 and len(deltas) > 2


def test_waiting_requests_run_in_order_of_priority_then_arrival(make_engine, prompts_of_lengths):
    engine = make_engine("llama", page_size=4, num_pages=64, max_num_batched_tokens=16, max_num_seqs=1)
    for (name, priority), prompt in zip([("a", 0), ("b", 5), ("c", -1), ("d", 0)],
                                        prompts_of_lengths([6, 6, 6, 6], seed=33)):
        engine.add_request(name, prompt, SamplingParams(max_tokens=2, temperature=0.0), priority=priority)
    finished = []
    while engine.has_unfinished():
        finished += [out.request_id for out in engine.step() if out.finished]
    assert finished == ["c", "a", "d", "b"]  # one at a time: lower priority first, ties as they came

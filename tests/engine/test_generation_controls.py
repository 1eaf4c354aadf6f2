"""max_tokens, stop tokens, EOS handling, stop strings, n samples, seeds and logprobs as
seen through `LLM.generate`."""

from __future__ import annotations

import pytest

from pdserve.engine import SamplingParams


@pytest.fixture
def llm(make_engine):
    return make_engine("llama", llm=True, page_size=4, num_pages=256)


@pytest.fixture
def prompt(prompts_of_lengths):
    return prompts_of_lengths([9], seed=11)[0]


def greedy(**kw):
    return SamplingParams(temperature=0.0, **kw)


def test_max_tokens_bounds_output_length(llm, prompt):
    for n in (1, 3, 17):
        out = llm.generate([prompt], greedy(max_tokens=n))[0]
        assert len(out.token_ids) == n and out.finish_reason == "length"


def test_stop_token_id_ends_output_and_is_kept(llm, prompt):
    full = llm.generate([prompt], greedy(max_tokens=12))[0].token_ids
    stop = full[4]
    first = full.index(stop)
    out = llm.generate([prompt], greedy(max_tokens=12, stop_token_ids=[stop]))[0]
    assert out.token_ids == full[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop  # vLLM's: the id that ended it


def test_eos_stops_unless_ignore_eos(llm, prompt):
    full = llm.generate([prompt], greedy(max_tokens=12))[0].token_ids
    eos = full[5]
    first = full.index(eos)
    llm.engine.eos_token_ids = {eos}  # make a token this model emits the EOS
    stopped = llm.generate([prompt], greedy(max_tokens=12))[0]
    assert stopped.token_ids == full[: first + 1] and stopped.finish_reason == "stop"
    assert stopped.stop_reason is None  # an EOS names no stop_reason, as vLLM's
    ignored = llm.generate([prompt], greedy(max_tokens=12, ignore_eos=True))[0]
    assert ignored.token_ids == full and ignored.finish_reason == "length" and ignored.stop_reason is None


def test_stop_string_is_cut_from_text(llm, prompts_of_lengths):
    # Use a prompt whose greedy text is long enough to hold a stop string in its middle.
    for p in prompts_of_lengths([5, 8, 12, 20], seed=12):
        full = llm.generate([p], greedy(max_tokens=16))[0]
        if len(full.text) >= 8:
            break
    stop = full.text[4:7]
    cut = full.text.find(stop)
    out = llm.generate([p], greedy(max_tokens=16, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:cut]
    # vLLM's include_stop_str_in_output: the string stays; of two beginning there, the first listed
    kept = llm.generate([p], greedy(max_tokens=16, stop=[stop[:2] + "\x00", stop, stop[:2]],
                                    include_stop_str_in_output=True))[0]
    assert kept.finish_reason == "stop" and kept.text == full.text[:cut + len(stop)]
    assert kept.stop_reason == stop


def test_special_tokens_are_left_out_of_the_text_unless_asked_for(llm, prompt):
    tokenizer = llm.engine.tokenizer
    user = tokenizer.convert_tokens_to_ids("<|user|>")  # special, and no stop token
    forced = dict(max_tokens=3, logit_bias={user: 100.0})
    skipped = llm.generate([prompt], greedy(**forced))[0]
    kept = llm.generate([prompt], greedy(**forced, skip_special_tokens=False))[0]
    assert skipped.token_ids == kept.token_ids == [user] * 3
    assert (skipped.text, kept.text) == ("", "<|user|>" * 3)
    assert kept.text == tokenizer.decode(kept.token_ids, skip_special_tokens=False)
    assert llm.generate([prompt], greedy(max_tokens=3))[0].text == \
        llm.generate([prompt], greedy(max_tokens=3, skip_special_tokens=False))[0].text  # no special: the same


def test_streamed_text_adds_up_and_never_contains_the_stop_string(make_engine, prompts_of_lengths):
    engine = make_engine("llama", page_size=4, num_pages=256)
    p = prompts_of_lengths([6], seed=13)[0]
    engine.add_request("full", p, greedy(max_tokens=20))
    full = _drain(engine)["full"][-1].text
    stop = full[6:8] if len(full) > 8 else full[-1]
    engine.add_request("s", p, greedy(max_tokens=20, stop=[stop]))
    deltas = _drain(engine)["s"]
    assert "".join(d.outputs[0].new_text for d in deltas) == deltas[-1].text
    assert stop not in deltas[-1].text and deltas[-1].finished


def test_n_samples_are_distinct_and_seed_reproducible(llm, prompt):
    params = SamplingParams(max_tokens=10, temperature=1.0, n=3, seed=1234)
    out = llm.generate([prompt], params)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    samples = [tuple(o.token_ids) for o in out.outputs]
    assert len(set(samples)) > 1, "n samples with one seed must not all be equal"
    # The same seed gives the same samples, whatever else is in the batch.
    other = SamplingParams(max_tokens=10, temperature=0.8)
    again = llm.generate([prompt, prompt, prompt[:5]], [other, params, other])[1]
    assert [tuple(o.token_ids) for o in again.outputs] == samples
    different = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=1.0, n=3, seed=99))[0]
    assert [tuple(o.token_ids) for o in different.outputs] != samples


def test_logprobs_of_chosen_tokens(llm, prompt):
    out = llm.generate([prompt], greedy(max_tokens=5, logprobs=3))[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 5
    for token, lp in zip(out.token_ids, lps):
        assert lp.token_id == token and lp.logprob <= 0.0
        assert len(lp.top_logprobs) == 3
        assert lp.top_logprobs[0][0] == token  # greedy picks the most likely
    assert llm.generate([prompt], greedy(max_tokens=2))[0].outputs[0].logprobs is None


def test_string_prompts_are_tokenized(llm):
    out = llm.generate(["the quick brown fox"], greedy(max_tokens=4, ignore_eos=True))[0]
    assert out.num_prompt_tokens == len(llm.tokenizer.encode("the quick brown fox"))
    assert len(out.token_ids) == 4


def _drain(engine):
    deltas = {}
    while engine.has_unfinished():
        for out in engine.step():
            deltas.setdefault(out.request_id, []).append(out)
    return deltas

"""Bans (engine/bans.py): what `min_tokens`, `bad_words` and `allowed_token_ids` ban step by
step, and greedy generation under them against transformers' `generate` with its own
processors for the same rules (`min_new_tokens` over the stop ids, `bad_words_ids`,
`suppress_tokens` over the ids not allowed)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import SamplingParams
from pdserve.engine.bans import Bans, BanRules


def test_each_rule_bans_what_the_output_has_earned():
    bans = Bans([5, 9, 7], 2, min_tokens=3, stop_ids=(2, 8), always=(4,), after=((7, 11), (9, 7, 12)))
    # output [7]: under min_tokens; 7 was just written, so (7, 11)'s 11 is banned; (9, 7, 12)
    # would need the prompt's 9, which does not count
    assert sorted(bans.now()) == [2, 4, 8, 11]
    bans.token_ids += [9, 7]  # output [7, 9, 7]: min_tokens reached
    assert sorted(bans.now()) == [4, 11, 12]
    bans.token_ids.append(3)
    assert bans.now() == [4]


def test_a_word_is_banned_alone_and_after_a_space(checkpoint_dirs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint_dirs("llama"))
    rules = BanRules(tok, {2})
    bans = rules.of(SamplingParams(bad_words=[" river", "mountain city"], min_tokens=1, stop_token_ids=[9]),
                    [1, 2, 3], 3)
    forms = {tuple(tok.encode(t, add_special_tokens=False))
             for t in ("river", " river", "mountain city", " mountain city")}
    assert {(t,) for t in bans.always} | set(bans.after) == forms
    assert bans.stop_ids == (9, 2)
    assert rules.of(SamplingParams(), [1], 1) is None
    assert rules.of(SamplingParams(min_tokens=2, ignore_eos=True), [1], 1).stop_ids == ()


@pytest.fixture(scope="module")
def hf_model(checkpoint_dirs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint_dirs("llama"), dtype=torch.float32).eval()


def test_min_tokens_holds_back_stop_ids_as_transformers_does(make_engine, hf_model, hf_greedy, prompts_of_lengths):
    from pdserve.benchmarks.constrained import transformers_greedy

    llm = make_engine("llama", llm=True, page_size=4, num_pages=256)
    prompts = prompts_of_lengths([7, 19], seed=5)
    for prompt in prompts:
        plain = hf_greedy("llama", prompt, 24)
        stop = plain[2]  # a stop id the plain answer meets at its third token
        params = SamplingParams(max_tokens=24, temperature=0.0, min_tokens=10, stop_token_ids=[stop])
        [out] = llm.generate([prompt], params)
        want = transformers_greedy(hf_model, [prompt], 24, 0, eos_token_id=[stop, *llm.engine.eos_token_ids],
                                   min_new_tokens=10)[0]
        assert out.token_ids == want and len(want) > 3
        [early] = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop]))
        assert len(early.token_ids) <= 3  # without min_tokens it stops there


def test_min_tokens_defers_a_stop_string(make_engine):
    llm = make_engine("llama", llm=True, page_size=4, num_pages=256)
    prompt = list(range(30, 45))
    [plain] = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0))
    stop = plain.text[1:3]  # a stop string in the plain answer's first tokens
    [early] = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, stop=[stop]))
    [late] = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, stop=[stop], min_tokens=12))
    assert len(early.token_ids) < 12 <= len(late.token_ids)
    assert late.token_ids[:len(early.token_ids)] == early.token_ids


def test_bad_words_are_never_written_as_transformers_bans_them(make_engine, hf_model, hf_greedy, prompts_of_lengths):
    from pdserve.benchmarks.constrained import transformers_greedy

    llm = make_engine("llama", llm=True, page_size=4, num_pages=256)
    tok = llm.engine.tokenizer
    for prompt in prompts_of_lengths([9, 23], seed=8):
        plain = hf_greedy("llama", prompt, 20)
        # a word the answer writes as one token, then one it writes as two (each as the
        # tokenizer writes that text: the tiny vocabulary has byte pieces that are not)
        one = next(plain[i:i + 1] for i in range(20) if round_trips(tok, plain[i:i + 1]))
        two = next(plain[i:i + 2] for i in range(19) if round_trips(tok, plain[i:i + 2]) and one[0] not in plain[i:i + 2])
        words = [tok.decode(one), tok.decode(two)]
        params = SamplingParams(max_tokens=20, temperature=0.0, bad_words=words)
        [out] = llm.generate([prompt], params)
        bans = llm.engine.bans.of(params, [], 0)
        want = transformers_greedy(hf_model, [prompt], 20, 0,
                                   bad_words_ids=[[t] for t in bans.always] + [list(f) for f in bans.after])[0]
        assert out.token_ids == want != plain
        assert one[0] not in out.token_ids


def round_trips(tok, ids: list[int]) -> bool:
    text = tok.decode(ids)
    return text.strip() != "" and tok.encode(text, add_special_tokens=False) == ids


def test_allowed_token_ids_are_all_that_is_sampled_as_transformers_suppresses_the_rest(
        make_engine, hf_model, hf_greedy, prompts_of_lengths):
    from pdserve.benchmarks.constrained import transformers_greedy

    llm = make_engine("llama", llm=True, page_size=4, num_pages=256)
    vocab = llm.engine.vocab_size
    for prompt in prompts_of_lengths([9, 23], seed=9):
        plain = hf_greedy("llama", prompt, 12)
        allowed = sorted(set(range(40, 200)) - set(plain[:3]))  # none of what it would write first; no EOS
        [out] = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, allowed_token_ids=allowed))
        want = transformers_greedy(hf_model, [prompt], 12, 0, eos=False,
                                   suppress_tokens=sorted(set(range(vocab)) - set(allowed)))[0]
        assert out.token_ids == want != plain and out.finish_reason == "length"
        sampled = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=1.0, seed=3, n=2,
                                                        allowed_token_ids=[50, 60, 70]))[0]
        assert set(sampled.token_ids) <= {50, 60, 70}


@pytest.mark.parametrize(("allowed", "named"), [([], "got '0 ids'"), ([3, 512], "got 512"), ([-1], "got -1"),
                                               ("7", "got '7'")])
def test_bad_allowed_token_ids_are_refused_with_the_value(allowed, named):
    with pytest.raises(ValueError, match="allowed_token_ids must be") as err:
        SamplingParams(allowed_token_ids=allowed).validate(512)
    assert named in str(err.value)

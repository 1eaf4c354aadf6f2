"""A prompt's logprobs (`prompt_logprobs`): each prompt token's logprob after the ones
before it, against transformers' own logits on the same checkpoint (fp32), whatever the
chunking, the prefix cache or the batch around it."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import SamplingParams
from pdserve.engine.checkpoint import FAMILIES


def _check(got, want: torch.Tensor, prompt: list[int], top: int) -> None:
    assert [s.token_id for s in got] == prompt[1:]
    chosen = want.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor([s.logprob for s in got]), chosen, atol=1e-4, rtol=0)
    values, ids = want.topk(top, dim=-1)
    for sample, row_values, row_ids in zip(got, values, ids):
        assert len(sample.top_logprobs) == top
        torch.testing.assert_close(torch.tensor([v for _, v in sample.top_logprobs]), row_values,
                                   atol=1e-4, rtol=0)
        # The ids agree wherever two alternatives are not (numerically) tied.
        assert all(t == int(i) or abs(v - float(rv)) < 1e-4
                   for (t, v), i, rv in zip(sample.top_logprobs, row_ids, row_values))


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_logprobs_match_transformers_in_chunks(make_engine, family, hf_logprobs, hf_greedy,
                                                      prompts_of_lengths):
    # A step budget of 8 tokens cuts the 21-token prompt into three chunks.
    llm = make_engine(family, llm=True, page_size=4, num_pages=64, max_num_batched_tokens=8)
    prompt = prompts_of_lengths([21], seed=5)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=3))[0]
    _check(out.prompt_logprobs, hf_logprobs(family, prompt), prompt, 3)
    assert out.token_ids == hf_greedy(family, prompt, 4)  # the output is what it would be anyway


def test_a_cached_prompt_is_still_scored_whole(make_engine, hf_logprobs, prompts_of_lengths):
    llm = make_engine("llama", llm=True, page_size=4, num_pages=64)
    prompt = prompts_of_lengths([18], seed=6)[0]
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3))[0]
    scored = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=0))[0]
    assert plain.num_cached_tokens == 0 and scored.num_cached_tokens == 0
    assert scored.token_ids == plain.token_ids and plain.prompt_logprobs is None
    _check(scored.prompt_logprobs, hf_logprobs("llama", prompt), prompt, 0)
    again = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3))[0]
    assert again.num_cached_tokens == 16  # the scored request's pages still enter the cache


def test_scored_and_plain_requests_share_steps(make_engine, hf_logprobs, prompts_of_lengths):
    llm = make_engine("llama", llm=True, page_size=4, num_pages=128, max_num_batched_tokens=16)
    prompts = prompts_of_lengths([13, 9, 30, 1], seed=7)
    alone = [llm.generate([p], SamplingParams(temperature=0.0, max_tokens=6))[0].token_ids for p in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=2 if i % 2 == 0 else None, n=2)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert [c.token_ids for c in out.outputs] == [alone[i]] * 2
        if i % 2:
            assert out.prompt_logprobs is None
        else:
            _check(out.prompt_logprobs, hf_logprobs("llama", prompt), prompt, 2)
    assert outs[3].prompt_logprobs is None  # (a 1-token prompt has nothing to score) ...
    one = llm.generate([prompts[3]], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1))[0]
    assert one.prompt_logprobs == []  # ... and, asked, an empty list


def test_a_reservation_for_received_kv_cannot_score_its_prompt(make_engine, prompts_of_lengths):
    engine = make_engine("llama", page_size=4, num_pages=32)
    prompt = prompts_of_lengths([10], seed=8)[0]
    with pytest.raises(ValueError, match="prompt_logprobs needs kv_window_end 0"):
        engine.prepare_receive("r", prompt, SamplingParams(prompt_logprobs=1), 8)
    assert "r" not in engine.requests


@pytest.mark.parametrize("value", [-1, 21, 1.5])
def test_prompt_logprobs_out_of_range_is_refused(make_engine, prompts_of_lengths, value):
    engine = make_engine("llama", page_size=4, num_pages=32)
    with pytest.raises(ValueError, match=rf"prompt_logprobs must be None or an integer in \[0, 20\], got {value}"):
        engine.add_request("r", prompts_of_lengths([5])[0], SamplingParams(prompt_logprobs=value))


def test_two_tensor_parallel_ranks_score_a_prompt(checkpoint_dirs, hf_logprobs, hf_greedy, prompts_of_lengths):
    from tests.engine.test_tensor_parallel import tp_llm

    llm = tp_llm(checkpoint_dirs("llama"), max_num_batched_tokens=8)
    try:
        prompts = prompts_of_lengths([13, 6], seed=9)
        greedy = dict(temperature=0.0, max_tokens=4, ignore_eos=True)
        outs = llm.generate(prompts, [SamplingParams(**greedy, prompt_logprobs=2), SamplingParams(**greedy)])
        assert [o.token_ids for o in outs] == [hf_greedy("llama", p, 4) for p in prompts]
        _check(outs[0].prompt_logprobs, hf_logprobs("llama", prompts[0]), prompts[0], 2)
        assert llm.engine.num_free_pages() == llm.engine.num_total_pages()
    finally:
        llm.close()

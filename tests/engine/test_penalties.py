"""Penalties and logit bias (engine/penalties.py): the batched adjustment against the
formulas applied one token at a time, the sampler around it, and greedy generation under
them against transformers' `generate` with the same rules as its logits processors."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import SamplingParams
from pdserve.engine.penalties import Penalties, penalize_
from pdserve.engine.sampler import SamplingRow, sample

VOCAB = 64


def reference(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """One row by the formulas: bias, then repetition over prompt and output, then OpenAI's
    frequency and presence over the output."""
    out = logits.clone()
    for t, b in p.logit_bias.items():
        out[t] += b
    output = p.token_ids[p.num_prompt_tokens:]
    for t in set(p.token_ids):
        out[t] = out[t] / p.repetition if out[t] > 0 else out[t] * p.repetition
    for t in set(output):
        out[t] -= output.count(t) * p.frequency + p.presence
    return out


def random_penalties(g: torch.Generator, n_prompt: int, n_out: int, **kw) -> Penalties:
    ids = torch.randint(0, VOCAB, (n_prompt + n_out,), generator=g).tolist()
    return Penalties(ids, n_prompt, **kw)


def test_a_batch_is_adjusted_as_each_row_alone_by_the_formulas():
    g = torch.Generator().manual_seed(0)
    rows = [
        random_penalties(g, 9, 0, repetition=1.5),  # the first token: the prompt alone counts
        random_penalties(g, 5, 30, presence=0.7, frequency=0.3),
        random_penalties(g, 12, 7, repetition=0.8, presence=-1.0, logit_bias={3: 100.0, 5: -100.0}),
        random_penalties(g, 3, 40, frequency=-2.0, logit_bias={63: 2.5}),
        random_penalties(g, 20, 1, logit_bias={0: -0.5}),  # bias alone: no counts needed
    ]
    logits = torch.randn(len(rows), VOCAB, generator=g) * 4
    got = penalize_(logits.clone(), rows)
    for j, row in enumerate(rows):
        torch.testing.assert_close(got[j], reference(logits[j], row), rtol=1e-6, atol=1e-6)
    assert not torch.equal(got, logits)
    first = [random_penalties(g, 6, 0, repetition=2.0), random_penalties(g, 4, 0, presence=1.0)]
    got = penalize_(logits[:2].clone(), first)  # no row has an output yet
    for j, row in enumerate(first):
        torch.testing.assert_close(got[j], reference(logits[j], row), rtol=1e-6, atol=1e-6)


def test_greedy_rows_take_the_adjusted_argmax_and_report_the_raw_logprobs():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, VOCAB, generator=g)
    best = logits.argmax(dim=-1).tolist()
    banned = Penalties([1, 2], 2, logit_bias={best[0]: -100.0})
    forced = Penalties([1, 2], 2, logit_bias={7: 100.0})
    rows = [SamplingRow(temperature=0.0, num_logprobs=1, penalties=banned),
            SamplingRow(temperature=0.0, num_logprobs=1),  # no penalties: the raw argmax
            SamplingRow(temperature=0.7, penalties=forced, generator=torch.Generator().manual_seed(3))]
    out = sample(logits.clone(), rows)
    assert out[0].token_id != best[0] and out[0].token_id == reference(logits[0], banned).argmax().item()
    assert out[1].token_id == best[1]
    assert out[2].token_id == 7
    raw = torch.log_softmax(logits, dim=-1)
    assert out[0].logprob == pytest.approx(raw[0, out[0].token_id].item(), abs=1e-6)
    assert out[0].top_logprobs[0][0] == best[0]  # the model's view, before the ban


CASES = {
    "repetition": dict(repetition_penalty=1.8),
    "presence-frequency": dict(presence_penalty=1.5, frequency_penalty=0.8),
    "encouraged": dict(repetition_penalty=0.7, frequency_penalty=-0.5),
    "bias": dict(logit_bias={40: 6.0, 41: 3.0, 100: -100.0}),
    "all": dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5, logit_bias={40: 2.0}),
}


@pytest.mark.parametrize("case", CASES)
def test_greedy_generation_under_penalties_matches_transformers(case, make_engine, hf_penalized,
                                                                 hf_greedy, prompts_of_lengths):
    llm = make_engine("llama", llm=True, page_size=4, num_pages=256)
    params = SamplingParams(max_tokens=24, temperature=0.0, **CASES[case])
    prompts = prompts_of_lengths([6, 17, 30], seed=21)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_penalized(prompt, params), f"prompt of {len(prompt)} tokens"
    # the penalties changed something: the test would notice them not applied
    plain = [hf_greedy("llama", p, params.max_tokens) for p in prompts]
    assert [o.token_ids for o in outs] != plain


def test_penalties_survive_preemption(make_engine, hf_penalized, prompts_of_lengths):
    # Each prompt needs 6-7 pages by the end; 6 prompts cannot all fit in 16 pages. A
    # preempted sequence recomputes its KV and keeps its tokens, hence its counts.
    llm = make_engine("llama", llm=True, page_size=4, num_pages=16, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=12, temperature=0.0, **CASES["all"])
    prompts = prompts_of_lengths([14, 15, 13, 16, 12, 15], seed=4)
    outs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_penalized(prompt, params)

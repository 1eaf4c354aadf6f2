"""A prompt's logprobs through the disaggregated path (router + prefill + decode on the tiny
checkpoint): OpenAI's `echo` with `logprobs` (what lm-eval-harness's loglikelihood sends)
and gRPC's `prompt_logprobs` score every prompt token as transformers does, even when the
nodes' prefix caches hold the prompt, and the rest of the answer is what it would be."""

from __future__ import annotations

import functools

import openai
import pytest
import torch

from pdserve.client import AsyncClient
from tests.cluster.nodes import run

@pytest.fixture(scope="module")
def model(api):
    return api.models.list().data[0].id


PROMPTS = ["the quick brown fox jumps over", [5, 17, 200, 33, 41, 9, 77, 120, 3]]


@pytest.fixture(scope="module")
def hf(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)

    @functools.lru_cache(maxsize=None)
    def logprobs(ids: tuple[int, ...]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)

    def ids_of(prompt) -> list[int]:
        return tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else prompt

    return ids_of, lambda ids: logprobs(tuple(ids)), tokenizer


def _assert_scored(token_logprobs, top_logprobs, want: torch.Tensor, ids: list[int]) -> None:
    assert token_logprobs[0] is None and top_logprobs[0] is None  # nothing before it
    chosen = want.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor(token_logprobs[1:len(ids)]), chosen, atol=1e-4, rtol=0)
    best = want.max(dim=-1).values
    for top, b in zip(top_logprobs[1:len(ids)], best):
        assert len(top) <= 2 and max(top.values()) == pytest.approx(float(b), abs=1e-4)


def test_echo_scores_a_batch_of_prompts_as_transformers_does(api, model, hf):
    ids_of, logprobs, tokenizer = hf
    for p in PROMPTS:  # the nodes' prefix caches now hold each prompt
        api.completions.create(model=model, prompt=p, max_tokens=2, temperature=0.0)
    scored = api.completions.create(model=model, prompt=PROMPTS, echo=True, logprobs=2,
                                    max_tokens=0, temperature=0.0)
    assert scored.usage.completion_tokens == 0
    assert scored.usage.total_tokens == scored.usage.prompt_tokens
    for choice, prompt in zip(scored.choices, PROMPTS):
        ids = ids_of(prompt)
        assert choice.finish_reason == "length"
        assert choice.text == (prompt if isinstance(prompt, str) else tokenizer.decode(ids))
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids)
        _assert_scored(lp.token_logprobs, lp.top_logprobs, logprobs(ids), ids)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_a_completion_is_the_prompt_then_the_plain_answer(api, model, hf, stream):
    ids_of, logprobs, _ = hf
    prompt = PROMPTS[0]
    plain = api.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0.0,
                                   logprobs=1, extra_body={"ignore_eos": True})
    answer = api.completions.create(model=model, prompt=prompt, echo=True, logprobs=1, max_tokens=4,
                                    temperature=0.0, stream=stream, extra_body={"ignore_eos": True})
    chunks = list(answer) if stream else [answer]
    text = "".join(c.choices[0].text for c in chunks)
    token_logprobs = [v for c in chunks for v in c.choices[0].logprobs.token_logprobs]
    top = [t for c in chunks for t in c.choices[0].logprobs.top_logprobs]
    ids = ids_of(prompt)
    assert text == prompt + plain.choices[0].text
    # (the same up to float rounding: here D computed the whole prompt, there P most of it)
    assert token_logprobs[len(ids):] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-4)
    _assert_scored(token_logprobs, top, logprobs(ids), ids)


@pytest.mark.parametrize("where", ["router", "colocated"])
def test_grpc_prompt_logprobs_name_each_token(cluster, colocated, hf, where):
    ids_of, logprobs, tokenizer = hf
    ids = PROMPTS[1]

    async def ask():
        async with AsyncClient(cluster.grpc if where == "router" else colocated.address) as client:
            return (await client.generate(ids, temperature=0.0, max_tokens=3, n=2, prompt_logprobs=3),
                    await client.generate(ids, temperature=0.0, max_tokens=3))

    scored, plain = run(ask())
    want = logprobs(ids)
    got = scored.prompt_logprobs
    assert [e.token_id for e in got] == ids[1:]
    assert [e.token for e in got] == [tokenizer.decode([t]) for t in ids[1:]]
    torch.testing.assert_close(torch.tensor([e.logprob for e in got]),
                               want.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1),
                               atol=1e-4, rtol=0)
    assert all(len(e.top) == 3 and e.top[0].token for e in got)
    assert [e.rank for e in got] == [1 + int((row > row[t]).sum()) for row, t in zip(want, ids[1:])]
    assert [c.token_ids for c in scored.choices] == [plain.token_ids] * 2
    assert scored.usage.cached_prompt_tokens == 0 and plain.prompt_logprobs is None
    if where == "router":  # the decode node computed the whole prompt
        assert scored.usage.route.skip_reason == "prompt_logprobs"


@pytest.mark.parametrize("api_name", ["completions", "chat"])
def test_vllm_prompt_logprobs_rank_each_token_as_transformers_does(api, model, hf, api_name):
    """vLLM's body field: per prompt token (the first None), the token and its likeliest,
    each with its logprob, its rank among all and its text; on completions in each choice,
    on chat beside the choices. Not with a stream."""
    from pdserve.router.tokenizer import PromptTokenizer

    ids_of, logprobs, tokenizer = hf
    if api_name == "chat":
        messages = [{"role": "user", "content": "name a fox"}]
        ids = PromptTokenizer(model).chat_ids(messages)  # as transformers renders it (test_chat_messages.py)
        answer = api.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0.0,
                                             extra_body={"prompt_logprobs": 2})
        scored = answer.model_extra["prompt_logprobs"]
    else:
        ids = ids_of(PROMPTS[0])
        answer = api.completions.create(model=model, prompt=PROMPTS[0], max_tokens=2, n=2, temperature=0.0,
                                        extra_body={"prompt_logprobs": 2})
        scored = answer.choices[0].model_extra["prompt_logprobs"]
        assert answer.choices[1].model_extra["prompt_logprobs"] == scored
    want = logprobs(ids)
    assert scored[0] is None and len(scored) == len(ids)
    for entry, row, token in zip(scored[1:], want, ids[1:]):
        ranks = {int(t): (v["rank"], v["decoded_token"]) for t, v in entry.items()}
        likeliest = row.argsort(descending=True)[:2].tolist()
        assert set(ranks) == {token, *likeliest}
        assert ranks[token] == (1 + int((row > row[token]).sum()), tokenizer.decode([token]))
        assert [ranks[t][0] for t in likeliest] == [1, 2]
        assert entry[str(token)]["logprob"] == pytest.approx(float(row[token]), abs=1e-4)
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        api.completions.create(model=model, prompt=PROMPTS[0], max_tokens=2, stream=True,
                               extra_body={"prompt_logprobs": 2})


def test_pdserve_generate_prints_the_prompts_logprobs_first(cluster, hf):
    from tests.cluster.test_client_library import pdserve_generate

    ids_of, _, tokenizer = hf
    shown = pdserve_generate(cluster, "--prompt", PROMPTS[0], "--prompt-logprobs", "2",
                             "--max-tokens", "2", "--temperature", "0").splitlines()
    ids = ids_of(PROMPTS[0])
    assert shown[0] == "--- prompt" and shown[len(ids)].startswith("--- choice 0")
    for line, t in zip(shown[1:len(ids)], ids[1:]):
        assert line.startswith(f"  token {t:>6} {tokenizer.decode([t])!r}"), line

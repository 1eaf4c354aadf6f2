"""Every sampling option through router + prefill + decode, checked by value against the
colocated node (the same engine without disaggregation): n choices with a seed, logprobs
and top logprobs (within 1e-4 in fp32), stop strings and stop ids, min_p, top_k and seed;
then the same through the OpenAI endpoint with the `openai` client; penalties and logit
bias against transformers' `generate`; structured output (gRPC, OpenAI's response_format,
vLLM's structured_outputs) against transformers masked by the same grammar; min_tokens,
bad_words and allowed_token_ids against transformers' own processors for them; and the
timings every result carries."""

from __future__ import annotations

import pytest

from pdserve.benchmarks.constrained import transformers_greedy, transformers_penalized
from pdserve.client import AsyncClient
from tests.cluster.nodes import run

PROMPT = [(i * 37) % 400 + 30 for i in range(40)]  # token ids: the same prompt everywhere
LONG = dict(max_tokens=8, ignore_eos=True)
CASES = {
    "n3-seeded": dict(n=3, seed=7, temperature=1.0, **LONG),
    "n2-top_k": dict(n=2, seed=11, temperature=0.9, top_k=5, **LONG),
    "n4-min_p-top_p": dict(n=4, seed=3, temperature=1.0, min_p=0.02, top_p=0.95, **LONG),
    "greedy-logprobs": dict(temperature=0.0, logprobs=3, **LONG),
    "seeded-logprobs-n2": dict(n=2, seed=5, temperature=1.0, logprobs=2, **LONG),
}


def both(cluster, colocated, **kwargs):
    async def go():
        async with AsyncClient(cluster.address("router")) as r, AsyncClient(colocated.address) as c:
            return await r.generate(PROMPT, **kwargs), await c.generate(PROMPT, **kwargs)
    return run(go())


def assert_same_logprobs(got, want):
    assert (got is None) == (want is None)
    for g, w in zip(got or [], want or [], strict=True):
        assert g.token_id == w.token_id and g.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert [t.token_id for t in g.top] == [t.token_id for t in w.top]
        assert [t.logprob for t in g.top] == pytest.approx([t.logprob for t in w.top], abs=1e-4)


@pytest.mark.parametrize("case", CASES)
def test_choices_and_logprobs_equal_the_colocated_node(cluster, colocated, case):
    params = CASES[case]
    disagg, coloc = both(cluster, colocated, **params)
    n = params.get("n", 1)
    assert [c.index for c in disagg.choices] == [c.index for c in coloc.choices] == list(range(n))
    assert not disagg.usage.route.remote_send_skipped  # the KV came from the prefill node
    for d, c in zip(disagg.choices, coloc.choices):
        assert d.token_ids == c.token_ids and d.text == c.text, (case, d.index)
        assert d.finish_reason == c.finish_reason == "length" and len(d.token_ids) == 8
        assert_same_logprobs(d.logprobs, c.logprobs)
        if params.get("logprobs"):
            assert all(len(e.top) == params["logprobs"] for e in d.logprobs)
    if n > 1 and params.get("temperature"):  # each choice is its own sample
        assert len({tuple(c.token_ids) for c in disagg.choices}) > 1


def test_top_k_1_and_min_p_1_are_greedy_and_a_seed_repeats(cluster, colocated):
    greedy, _ = both(cluster, colocated, temperature=0.0, **LONG)
    top1, _ = both(cluster, colocated, temperature=1.0, top_k=1, seed=1, **LONG)
    min_p1, _ = both(cluster, colocated, temperature=1.0, min_p=1.0, seed=2, **LONG)
    assert top1.token_ids == min_p1.token_ids == greedy.token_ids
    once, _ = both(cluster, colocated, temperature=1.0, seed=42, **LONG)
    again, _ = both(cluster, colocated, temperature=1.0, seed=42, **LONG)
    other, _ = both(cluster, colocated, temperature=1.0, seed=43, **LONG)
    assert once.token_ids == again.token_ids != other.token_ids


def test_stop_string_and_stop_id_end_every_choice_as_on_the_colocated_node(cluster, colocated):
    free, _ = both(cluster, colocated, temperature=0.0, **LONG)
    stop_text = free.text[len(free.text) // 2:][:3]
    by_text, coloc_text = both(cluster, colocated, temperature=0.0, stop=[stop_text], **LONG)
    assert by_text.text == coloc_text.text == free.text[:free.text.index(stop_text)]
    assert by_text.finish_reason == coloc_text.finish_reason == "stop"
    assert by_text.stop_reason == coloc_text.stop_reason == stop_text  # vLLM's: what ended it
    stop_id = free.token_ids[3]
    by_id, coloc_id = both(cluster, colocated, temperature=0.0, stop_token_ids=[stop_id], **LONG)
    assert by_id.token_ids == coloc_id.token_ids
    assert by_id.token_ids == free.token_ids[:free.token_ids.index(stop_id) + 1]
    assert by_id.finish_reason == coloc_id.finish_reason == "stop"
    assert by_id.stop_reason == coloc_id.stop_reason == stop_id and free.stop_reason is None
    seeded, coloc_seeded = both(cluster, colocated, n=3, seed=9, temperature=1.0,
                                stop_token_ids=[stop_id], **LONG)
    for d, c in zip(seeded.choices, coloc_seeded.choices, strict=True):
        assert (d.token_ids, d.finish_reason) == (c.token_ids, c.finish_reason)


def test_openai_completions_carry_the_same_choices_and_logprobs(api, cluster, colocated):
    params = dict(n=3, seed=7, temperature=1.0, max_tokens=8, logprobs=2)
    _, coloc = both(cluster, colocated, ignore_eos=True, **params)
    out = api.completions.create(model=cluster.model, prompt=PROMPT, **params,
                                 extra_body={"ignore_eos": True, "top_k": -1, "min_p": 0.0})
    assert [c.index for c in out.choices] == [0, 1, 2]
    for got, want in zip(out.choices, coloc.choices, strict=True):
        assert got.text == want.text and got.finish_reason == want.finish_reason == "length"
        assert got.logprobs.token_logprobs == pytest.approx(
            [e.logprob for e in want.logprobs], abs=1e-4)
        # OpenAI keys top logprobs by token text: two ids of the same text share one entry
        for top, entry in zip(got.logprobs.top_logprobs, want.logprobs, strict=True):
            assert 1 <= len(top) <= 2
            assert max(top.values()) == pytest.approx(entry.top[0].logprob, abs=1e-4)
    timings = out.usage.model_extra["timings"]
    assert timings["time_per_output_token_s"] > 0 and timings["prefill_time_s"] > 0
    assert timings["kv_transfer_time_s"] > 0 and timings["time_to_first_token_s"] > 0


def test_openai_chat_logprobs_stop_and_top_k_equal_grpc(api, cluster, colocated):
    messages = [{"role": "user", "content": "name three colours"}]

    async def grpc_answer(**kwargs):
        async with AsyncClient(colocated.address) as c:
            return await c.generate(messages=messages, **kwargs)

    want = run(grpc_answer(temperature=0.0, logprobs=2, max_tokens=6, ignore_eos=True))
    got = api.chat.completions.create(model=cluster.model, messages=messages, temperature=0.0,
                                      max_tokens=6, logprobs=True, top_logprobs=2,
                                      extra_body={"ignore_eos": True, "top_k": 1})
    content = got.choices[0].logprobs.content
    assert got.choices[0].message.content == want.text
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in want.logprobs],
                                                         abs=1e-4)
    assert all(len(c.top_logprobs) == 2 for c in content)
    stop_text = want.text[2:5]
    stopped = api.chat.completions.create(model=cluster.model, messages=messages, temperature=0.0,
                                          max_tokens=6, stop=[stop_text],
                                          extra_body={"ignore_eos": True})
    assert stopped.choices[0].message.content == want.text[:want.text.index(stop_text)]
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].stop_reason == stop_text
    streamed = api.chat.completions.create(model=cluster.model, messages=messages, temperature=0.0,
                                           max_tokens=6, stop=[stop_text], stream=True,
                                           extra_body={"ignore_eos": True})
    last = [c.choices[0] for c in streamed if c.choices][-1]
    assert (last.finish_reason, last.stop_reason) == ("stop", stop_text)


def test_penalties_and_logit_bias_through_the_router_match_transformers(api, cluster, tiny_model):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    penalties = dict(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.4,
                     logit_bias={40: 3.0, 41: -100.0})
    want = transformers_penalized(model, [PROMPT], 12, 0, **penalties)[0]
    assert want != transformers_penalized(model, [PROMPT], 12, 0)[0]  # they change the answer

    async def go():
        async with AsyncClient(cluster.address("router")) as r:
            return await r.generate(PROMPT, max_tokens=12, temperature=0.0, **penalties)

    got = run(go())
    assert not got.usage.route.remote_send_skipped  # the KV came from the prefill node
    assert got.token_ids == want
    out = api.completions.create(model=cluster.model, prompt=PROMPT, max_tokens=12, temperature=0.0,
                                 presence_penalty=0.6, frequency_penalty=0.4,
                                 logit_bias={"40": 3, "41": -100},
                                 extra_body={"repetition_penalty": 1.4})
    assert out.choices[0].text == got.text


def test_min_tokens_and_bad_words_through_the_router_match_transformers(api, cluster, tiny_model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model)
    plain = transformers_greedy(model, [PROMPT], 12, 0)[0]
    word = next(tok.decode([t]) for t in plain if tok.encode(tok.decode([t]), add_special_tokens=False) == [t])
    forms = [tok.encode(w, add_special_tokens=False) for w in (word.lstrip(), " " + word.lstrip())]
    stop = plain[1]  # the plain answer would stop at its second token
    want = transformers_greedy(model, [PROMPT], 12, 0, eos_token_id=[stop, tok.eos_token_id], min_new_tokens=6,
                               bad_words_ids=forms)[0]
    assert len(want) > 2 and tok.encode(word, add_special_tokens=False)[0] not in want
    out = api.completions.create(model=cluster.model, prompt=PROMPT, max_tokens=12, temperature=0.0,
                                 extra_body={"min_tokens": 6, "bad_words": [word], "stop_token_ids": [stop]})
    assert out.choices[0].text == tok.decode(want, skip_special_tokens=True)


def test_allowed_token_ids_through_the_router_match_transformers_suppressing_the_rest(api, cluster, tiny_model):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    tok, vocab = AutoTokenizer.from_pretrained(tiny_model), AutoConfig.from_pretrained(tiny_model).vocab_size
    plain = transformers_greedy(model, [PROMPT], 10, 0)[0]
    allowed = sorted(set(range(30, 300)) - set(plain[:2]))
    want = transformers_greedy(model, [PROMPT], 10, 0, eos=False,
                               suppress_tokens=sorted(set(range(vocab)) - set(allowed)))[0]
    out = api.completions.create(model=cluster.model, prompt=PROMPT, max_tokens=10, temperature=0.0,
                                 extra_body={"allowed_token_ids": allowed, "return_token_ids": True})
    assert out.choices[0].token_ids == want != plain[:10]


def test_structured_output_through_the_router_matches_transformers_masked_alike(api, cluster, tiny_model):
    import json
    import re

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from xgrammar.contrib.hf import LogitsProcessor

    from pdserve.engine.completion import eos_token_ids
    from pdserve.engine.structured import Grammars
    from pdserve.sampling import StructuredOutput

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    config, tokenizer = AutoConfig.from_pretrained(tiny_model), AutoTokenizer.from_pretrained(tiny_model)
    grammars = Grammars(tokenizer, config.vocab_size, eos_token_ids(config, tokenizer))

    def want(spec: StructuredOutput, max_new: int) -> list[int]:
        return transformers_greedy(model, [PROMPT], max_new, 0,
                                   processors=lambda _: [LogitsProcessor(grammars.compiled(spec))])[0]

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}

    async def go():
        async with AsyncClient(cluster.address("router")) as r:
            return await r.generate(PROMPT, max_tokens=16, temperature=0.0,
                                    structured_output={"choice": {"choices": ["cat", "dog", "bird"]}})

    choice = run(go())
    assert not choice.usage.route.remote_send_skipped  # the KV came from the prefill node
    assert choice.text in ("cat", "dog", "bird") and choice.finish_reason == "stop"
    assert choice.token_ids == want(StructuredOutput("choice", ("cat", "dog", "bird")), 16)
    # (response_format is chat's in OpenAI's client; pdserve, like vLLM, takes it on both)
    as_schema = api.completions.create(model=cluster.model, prompt=PROMPT, max_tokens=12, temperature=0.0,
                                       extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                           "name": "n", "schema": schema}}})
    spec = StructuredOutput("json_schema", json.dumps(schema))
    assert as_schema.choices[0].text == tokenizer.decode(want(spec, 12), skip_special_tokens=True)
    messages = [{"role": "user", "content": "code?"}]
    regex = api.chat.completions.create(model=cluster.model, messages=messages, max_tokens=12, temperature=0.0,
                                        extra_body={"structured_outputs": {"regex": "[A-Z]{2}[0-9]{2}"}})
    assert re.fullmatch("[A-Z]{2}[0-9]{2}", regex.choices[0].message.content)
    as_object = api.chat.completions.create(model=cluster.model, messages=messages, max_tokens=8, temperature=0.0,
                                            response_format={"type": "json_object"})
    assert as_object.choices[0].message.content.startswith("{")


def test_usage_timings_of_disaggregated_and_colocated_requests(cluster, colocated):
    disagg, coloc = both(cluster, colocated, temperature=0.0, **LONG)
    d, c = disagg.usage, coloc.usage
    assert not d.route.remote_send_skipped and c.route is None
    for u in (d, c):
        # At least a tenth of the gaps are at least their (nearest-rank) p90, so the mean is
        # at least a tenth of it; no upper bound: one stall of a loaded machine lifts the mean
        # past any multiple of the p90.
        assert 0 < u.time_per_output_token_p90_s / 10 <= u.time_per_output_token_s
        assert u.time_per_output_token_p90_s > 0 and u.prefill_time_s > 0
        assert u.time_to_first_token_s > 0 and u.queue_time_s >= 0
    assert d.kv_transfer_time_s > 0 and c.kv_transfer_time_s == 0
    # the prefill and the KV writes happen before the first token: they fit inside its time
    assert d.prefill_time_s + d.kv_transfer_time_s < d.time_to_first_token_s

"""Structured output (engine/structured.py): greedy text under a JSON Schema, any JSON object,
a regular expression, a choice or a grammar equals transformers' `generate` masked by the
same compiled grammar (xgrammar's own transformers processor), in a batch with free rows
and through preemption; sampled text matches; what does not compile is refused, naming it."""

from __future__ import annotations

import json
import re

import pytest
import torch

from pdserve.benchmarks.constrained import transformers_greedy
from pdserve.engine import SamplingParams
from pdserve.sampling import StructuredOutput

SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                     "required": ["a", "b"]})
SPECS = {
    "choice": StructuredOutput("choice", ("red", "green", "blue")),
    "regex": StructuredOutput("regex", r"[0-9]{3}-[a-z]{2}"),
    "grammar": StructuredOutput("grammar", 'root ::= "yes" | "no" | "maybe " [0-9]'),
    "json_schema": StructuredOutput("json_schema", SCHEMA),
    "json_object": StructuredOutput("json_object"),
}


@pytest.fixture(scope="module")
def hf_model(checkpoint_dirs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint_dirs("llama"), dtype=torch.float32).eval()


def hf_structured(model, engine, prompt: list[int], spec: StructuredOutput, max_new: int) -> list[int]:
    """transformers' greedy continuation, masked by xgrammar's processor with the grammar
    the engine compiles (the same tokenizer tables and end-of-sequence tokens)."""
    from xgrammar.contrib.hf import LogitsProcessor

    return transformers_greedy(model, [prompt], max_new, 0,
                               processors=lambda _: [LogitsProcessor(engine.grammars.compiled(spec))])[0]


@pytest.fixture
def llm(make_engine):
    return make_engine("llama", llm=True, page_size=4, num_pages=256)


def test_greedy_structured_text_equals_transformers_masked_by_the_same_grammar(llm, hf_model, prompts_of_lengths):
    prompts = prompts_of_lengths([5, 12, 21, 9, 30], seed=41)
    params = [SamplingParams(max_tokens=24, temperature=0.0, structured_output=spec) for spec in SPECS.values()]
    # one batch: every kind at once, beside a free row
    outs = llm.generate([*prompts, prompts[0]], [*params, SamplingParams(max_tokens=24, temperature=0.0)])
    for prompt, p, out, kind in zip(prompts, params, outs, SPECS):
        assert out.token_ids == hf_structured(hf_model, llm.engine, prompt, p.structured_output, 24), kind
    texts = {kind: out.text for kind, out in zip(SPECS, outs)}
    assert texts["choice"] in ("red", "green", "blue") and outs[0].finish_reason == "stop"
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", texts["regex"]) and outs[1].finish_reason == "stop"
    assert re.fullmatch(r"yes|no|maybe [0-9]", texts["grammar"])
    assert texts["json_schema"].startswith('{"a":') and texts["json_object"].startswith("{")
    assert outs[-1].text not in ("red", "green", "blue")  # the free row is not held to anything


def test_sampled_choices_match_and_preemption_keeps_each_grammar(make_engine, hf_model, prompts_of_lengths):
    llm = make_engine("llama", llm=True, page_size=4, num_pages=16, max_num_batched_tokens=64)
    spec = SPECS["regex"]
    sampled = SamplingParams(max_tokens=10, temperature=1.0, seed=3, n=3, structured_output=spec)
    for out in llm.generate(prompts_of_lengths([7], seed=42), sampled)[0].outputs:
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", out.text), out.text
    # 6 prompts of 12-16 tokens cannot all fit in 16 pages of 4 while they generate
    prompts = prompts_of_lengths([14, 15, 13, 16, 12, 15], seed=4)
    params = SamplingParams(max_tokens=12, temperature=0.0, structured_output=SPECS["json_schema"])
    outs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_structured(hf_model, llm.engine, prompt, params.structured_output, 12)


@pytest.mark.parametrize("spec,message", [
    (StructuredOutput("regex", "(ab"), r"structured_output.regex does not compile: Regex parsing error"),
    (StructuredOutput("grammar", "root ::= undefined_rule"), r"structured_output.grammar does not compile: .*undefined_rule"),
    (StructuredOutput("json_schema", '{"type": "nope"}'), r"structured_output.json_schema does not compile: .*nope"),
    (StructuredOutput("json_schema", "{not json"), r"structured_output.json_schema must be a JSON Schema in JSON"),
    (StructuredOutput("choice", ()), r"structured_output.choice must be 1 to 256 non-empty strings"),
])
def test_a_structure_that_does_not_compile_is_refused_naming_it(llm, spec, message):
    engine = llm.engine
    with pytest.raises(ValueError, match=message):
        engine.add_request("x", [5, 6, 7], SamplingParams(max_tokens=4, structured_output=spec))
    with pytest.raises(ValueError, match="ignore_eos cannot be combined with structured_output"):
        engine.add_request("x", [5, 6, 7], SamplingParams(structured_output=SPECS["choice"], ignore_eos=True))
    assert not engine.has_unfinished() and engine.num_free_pages() == engine.num_total_pages()

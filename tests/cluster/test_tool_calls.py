"""Tool calling through router + prefill + decode with the `openai` client: a named function
and "required" give the calls transformers' greedy `generate` writes on the same prompt,
masked by xgrammar with the same schema (streamed: the same calls in deltas); "auto" with
no call written gives transformers' plain text, with no calls."""

from __future__ import annotations

import json

import pytest

from pdserve.benchmarks.constrained import transformers_greedy
from pdserve.router.tokenizer import PromptTokenizer
from pdserve.router.tools import tools_from_body

MODE = {"type": "function", "function": {
    "name": "set_mode", "description": "Turn the light on or off",
    "parameters": {"type": "object", "properties": {"mode": {"enum": ["on", "off"]}}, "required": ["mode"]}}}
MESSAGES = [{"role": "user", "content": "the light, please"}]
NAMED = {"type": "function", "function": {"name": "set_mode"}}


@pytest.fixture(scope="module")
def oracle(tiny_model):
    """(tool_choice, max_tokens, **body) -> the text transformers writes for MESSAGES with MODE,
    masked by the structure that choice asks for, and whether it stopped by itself."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from xgrammar.contrib.hf import LogitsProcessor

    from pdserve.engine.completion import eos_token_ids
    from pdserve.engine.structured import Grammars
    from pdserve.sampling import StructuredOutput

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    config, tokenizer = AutoConfig.from_pretrained(tiny_model), AutoTokenizer.from_pretrained(tiny_model)
    eos = eos_token_ids(config, tokenizer)
    grammars = Grammars(tokenizer, config.vocab_size, eos)

    def text(choice, max_tokens: int, **body) -> tuple[str, bool]:
        tools = tools_from_body({"tools": [MODE], "tool_choice": choice, **body})
        prompt = PromptTokenizer(tiny_model).chat_ids(MESSAGES, tools)
        structure = tools.structure()
        spec = structure and StructuredOutput("json_schema", structure.json_schema)
        ids = transformers_greedy(model, [prompt], max_tokens, 0, processors=lambda _: [
            LogitsProcessor(grammars.compiled(spec))] if spec else [])[0]
        stopped = bool(ids) and ids[-1] in eos
        return tokenizer.decode(ids, skip_special_tokens=True), stopped
    return text


def ask(api, cluster, choice, max_tokens: int, **extra):
    return api.chat.completions.create(model=cluster.model, messages=MESSAGES, tools=[MODE], tool_choice=choice,
                                       max_tokens=max_tokens, temperature=0.0, **extra)


def test_a_named_function_is_called_with_the_arguments_transformers_writes(api, cluster, oracle):
    want, stopped = oracle(NAMED, 24)
    assert stopped and json.loads(want)["mode"] in ("on", "off")  # the schema is small enough to finish
    choice = ask(api, cluster, NAMED, 24).choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert (call.type, call.function.name, call.function.arguments) == ("function", "set_mode", want)
    assert call.id.startswith("call_")
    deltas = [c.choices[0].delta.tool_calls for c in ask(api, cluster, NAMED, 24, stream=True)
              if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0][0].id and deltas[0][0].function.name == "set_mode"
    assert "".join(d[0].function.arguments or "" for d in deltas) == want


def test_required_makes_the_calls_transformers_writes_and_streams_them_whole(api, cluster, oracle):
    want, stopped = oracle("required", 64, parallel_tool_calls=False)
    assert stopped
    [written] = json.loads(want)
    for stream in (False, True):
        answer = ask(api, cluster, "required", 64, parallel_tool_calls=False, stream=stream)
        if stream:
            chunks = [c.choices[0] for c in answer if c.choices]
            assert all(c.delta.role or c.delta.tool_calls for c in chunks)  # no empty chunk while held
            calls = [d for c in chunks for d in c.delta.tool_calls or ()]
            finish = chunks[-1].finish_reason
        else:
            calls, finish = answer.choices[0].message.tool_calls, answer.choices[0].finish_reason
        assert finish == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
            [(written["name"], written["arguments"])]


def test_auto_without_a_call_written_is_text(api, cluster, oracle):
    want, _ = oracle("auto", 8)
    choice = ask(api, cluster, "auto", 8).choices[0]
    assert choice.message.tool_calls is None and choice.message.content == want


def test_grpc_clients_get_the_same_calls(cluster, oracle):
    """The client library over the router's gRPC API: the named call and "required"'s calls
    transformers writes, parsed into `tool_calls`; "auto" without a call, its plain text."""
    from pdserve.client import Client

    named, _ = oracle(NAMED, 24)
    [written] = json.loads(oracle("required", 64, parallel_tool_calls=False)[0])
    plain, _ = oracle("auto", 8)
    with Client(cluster.grpc) as client:
        def ask_grpc(choice, max_tokens, **extra):
            return client.generate(messages=MESSAGES, tools=[MODE], tool_choice=choice, max_tokens=max_tokens,
                                   temperature=0.0, **extra)
        forced = ask_grpc("set_mode", 24)
        required = ask_grpc("required", 64, parallel_tool_calls=False)
        auto = ask_grpc("auto", 8)
    assert (forced.text, forced.finish_reason) == ("", "stop")
    assert [(c.name, c.arguments) for c in forced.tool_calls] == [("set_mode", named)]
    assert required.finish_reason == "tool_calls" and required.text == ""
    assert [(c.name, json.loads(c.arguments)) for c in required.tool_calls] == [(written["name"], written["arguments"])]
    assert (auto.text, auto.tool_calls) == (plain, [])

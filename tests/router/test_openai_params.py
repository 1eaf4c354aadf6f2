"""No OpenAI parameter is silently ignored: each is implemented, accepted only at its neutral
value, or refused with a 400 naming it (router/openai_protocol.py `check_fields`)."""

from __future__ import annotations

import json

import pytest

from pdserve.router.openai_protocol import (IMPLEMENTED, IMPLEMENTED_ONLY, NEUTRAL, OpenAIError,
                                    sampling_from_body)


def sampling(body: dict, chat: bool = False):
    return sampling_from_body({"model": "m", **body}, chat=chat, default_max_tokens=16)


@pytest.mark.parametrize("chat,name,value", [
    (False, "tools", [{"type": "function", "function": {"name": "f"}}]), (False, "tool_choice", "auto"),
    (False, "reasoning_effort", "low"), (True, "suffix", "end"),
    *((chat, name, value) for chat in (False, True) for name, value in [
        ("function_call", "auto"), ("store", True),
        ("metadata", {"k": "v"}), ("service_tier", "flex"), ("modalities", ["audio"]),
        ("audio", {"voice": "x"}), ("prediction", {"type": "content"}),
        ("web_search_options", {}),
        ("foo", 1)]),
])
def test_a_parameter_pdserve_lacks_is_a_400_naming_it(chat, name, value):
    """(Tools and reasoning_effort are chat's: tests/router/test_tools.py,
    tests/router/test_chat_template_options.py.)"""
    with pytest.raises(OpenAIError) as err:
        sampling({name: value}, chat)
    assert err.value.status == 400 and err.value.param == name and name in err.value.message


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_neutral_values_are_accepted(chat):
    neutral = {name: values[0] for name, values in NEUTRAL.items() if values}
    neutral.update({name: None for name, values in NEUTRAL.items() if not values})
    assert sampling(neutral, chat).max_tokens == 16


def test_echo_is_for_completions_only():
    assert sampling({"echo": True, "logprobs": 2}).prompt_logprobs == 2  # router/echo.py
    assert not sampling({"echo": True}).HasField("prompt_logprobs")
    assert sampling({"echo": True, "max_tokens": 0}).max_tokens == 1
    with pytest.raises(OpenAIError, match="unknown parameter 'echo' for chat completions") as err:
        sampling({"echo": True}, chat=True)
    assert err.value.param == "echo"


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_penalties_and_logit_bias_reach_the_sampling_params(chat):
    pb = sampling({"presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2,
                   "logit_bias": {"50": 5, "7": -100}}, chat)
    assert (pb.presence_penalty, pb.frequency_penalty) == (0.5, -1.0)
    assert pb.repetition_penalty == pytest.approx(1.2) and dict(pb.logit_bias) == {50: 5.0, 7: -100.0}
    assert not sampling({}, chat).HasField("repetition_penalty")  # unset: off
    bans = sampling({"min_tokens": 4, "bad_words": ["river", "a b"], "allowed_token_ids": [7, 9]}, chat)
    assert (bans.min_tokens, list(bans.bad_words), list(bans.allowed_token_ids)) == (4, ["river", "a b"], [7, 9])


@pytest.mark.parametrize("name,value,says", [
    ("presence_penalty", "high", "presence_penalty must be a number, got 'high'"),
    ("repetition_penalty", True, "repetition_penalty must be a number"),
    ("logit_bias", {"fifty": 5}, "logit_bias must map token ids"),
    ("logit_bias", {"50": "5"}, "logit_bias must map token ids"),
    ("logit_bias", [50, 5], "logit_bias must map token ids"),
    ("logit_bias", {"-3": 5}, "logit_bias must be keyed by token ids, got -3"),
    ("min_tokens", 2.5, "min_tokens must be an integer, got 2.5"),
    ("bad_words", "river", "bad_words must be a list of strings, got 'river'"),
    ("bad_words", ["river", 3], "bad_words must be a list of strings"),
    ("allowed_token_ids", [], "allowed_token_ids must be a non-empty list of token ids, got []"),
    ("allowed_token_ids", [1, "2"], "allowed_token_ids must be a non-empty list of token ids"),
    ("allowed_token_ids", [True], "allowed_token_ids must be"),
])
def test_a_malformed_penalty_or_bias_is_a_400_naming_it(name, value, says):
    # Ranges (ids in the vocabulary, [-2, 2], [-100, 100]) are the shared rules', checked
    # where the model is known (tests/cluster/test_bad_input.py).
    with pytest.raises(OpenAIError) as err:
        sampling({name: value})
    assert err.value.status == 400 and err.value.param == name and says in err.value.message


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_response_format_and_structured_outputs_become_one_structure(chat):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, ("json_object", True)),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
         ("json_schema", json.dumps(schema))),
        ({"structured_outputs": {"json": schema}}, ("json_schema", json.dumps(schema))),
        ({"structured_outputs": {"json": '{"type": "string"}'}}, ("json_schema", '{"type": "string"}')),
        ({"structured_outputs": {"regex": "[a-z]+", "choice": None}}, ("regex", "[a-z]+")),
        ({"structured_outputs": {"choice": ["a", "b"]}}, ("choice", ["a", "b"])),
        ({"structured_outputs": {"grammar": 'root ::= "x"'}}, ("grammar", 'root ::= "x"')),
    ]
    for body, want in cases:
        pb = sampling(body, chat)
        if want is None:
            assert not pb.HasField("structured_output"), body
            continue
        kind = pb.structured_output.WhichOneof("kind")
        value = getattr(pb.structured_output, kind)
        assert (kind, list(value.choices) if kind == "choice" else value) == want, body


@pytest.mark.parametrize("body,param,says", [
    ({"response_format": {"type": "xml"}}, "response_format", "response_format must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "response_format.json_schema.schema must be a JSON Schema object, got None"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"bnf": "x"}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"choice": "abc"}}, "structured_outputs", "structured_outputs.choice has the wrong type"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "ask for two structures"),
])
def test_a_structure_neither_field_can_say_is_a_400_naming_it(body, param, says):
    with pytest.raises(OpenAIError) as err:
        sampling(body)
    assert err.value.status == 400 and err.value.param == param and says in err.value.message, err.value.message


def test_best_of_must_equal_n():
    assert sampling({"best_of": 3, "n": 3}).n == 3
    assert sampling({"best_of": 1}).max_tokens == 16
    with pytest.raises(OpenAIError, match="best_of must equal n") as err:
        sampling({"best_of": 4, "n": 2})
    assert err.value.param == "best_of"


def test_top_logprobs_needs_logprobs_in_chat():
    assert sampling({"logprobs": True, "top_logprobs": 3}, chat=True).logprobs == 3
    with pytest.raises(OpenAIError, match="top_logprobs needs logprobs") as err:
        sampling({"top_logprobs": 3}, chat=True)
    assert err.value.param == "top_logprobs"


def test_each_endpoint_refuses_the_others_fields():
    with pytest.raises(OpenAIError, match="unknown parameter 'messages' for completions"):
        sampling({"messages": []})
    with pytest.raises(OpenAIError, match="unknown parameter 'prompt' for chat completions"):
        sampling({"prompt": "x"}, chat=True)


def test_user_and_safety_identifier_are_strings():
    assert sampling({"user": "alice"}).max_tokens == 16
    assert sampling({"safety_identifier": "h-alice"}, chat=True).max_tokens == 16
    with pytest.raises(OpenAIError, match="user must be a string"):
        sampling({"user": 7})
    with pytest.raises(OpenAIError, match="safety_identifier must be a string, got 7"):
        sampling({"safety_identifier": 7}, chat=True)


def test_a_prompt_cache_key_is_a_string_that_places_the_request():
    from pdserve.router.openai_protocol import placement_of

    for chat in (False, True):
        assert sampling({"prompt_cache_key": "conversation-7"}, chat).max_tokens == 16
    assert placement_of({"prompt_cache_key": "conversation-7"})["cache_key"] == "conversation-7"
    assert placement_of({})["cache_key"] == ""
    from pdserve.router.responses_api import chat_body  # /v1/responses passes it on as chat's
    assert chat_body({"model": "m", "input": "hi", "prompt_cache_key": "k"})["prompt_cache_key"] == "k"
    with pytest.raises(OpenAIError, match="prompt_cache_key must be a string, got 7") as err:
        placement_of({"prompt_cache_key": 7})
    assert err.value.param == "prompt_cache_key"


def test_every_parameter_has_one_decision():
    both = IMPLEMENTED | IMPLEMENTED_ONLY[False] | IMPLEMENTED_ONLY[True]
    assert not both & set(NEUTRAL)


def test_the_end_user_ids_reach_the_request_log_line(tmp_path, caplog):
    import aiohttp

    from pdserve.runtime.logs import REQUEST_LOGGER
    from tests.router.fake_worker import FakeWorker, openai_router, run
    from tests.router.test_background_responses import chat_tokenizer

    caplog.set_level("INFO", logger=REQUEST_LOGGER.name)

    async def go():
        async with openai_router([FakeWorker("d")], chat_tokenizer(tmp_path)) as url, aiohttp.ClientSession() as s:
            body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                    "user": "alice", "safety_identifier": "h-alice"}
            async with s.post(url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "who-1"}) as reply:
                return reply.status

    assert run(go()) == 200
    [line] = [r.fields for r in caplog.records if getattr(r, "fields", {}).get("request_id") == "who-1"]
    assert (line["user"], line["safety_identifier"]) == ("alice", "h-alice")

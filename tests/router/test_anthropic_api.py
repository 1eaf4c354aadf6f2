"""The Messages API's parts at the router (router/anthropic_api.py), no model running: a
request maps to the chat request it means; a chat answer's chunks (thinking, text, calls)
become content blocks whose events, replayed, give the whole message; a failure after the
start ends the stream with Anthropic's error event; and any body is an answer or
Anthropic's 400, never a 500."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.router.anthropic_api import MessageStream, chat_body
from pdserve.router.openai_protocol import OpenAIError
from tests.router.test_responses_api import json_values, thinking_text_and_calls

MODE = {"name": "set_mode", "description": "on or off", "input_schema": {"type": "object"},
        "cache_control": {"type": "ephemeral"}}


def test_a_request_is_the_chat_request_it_means():
    body = {"model": "m", "max_tokens": 9, "temperature": 0.5, "top_k": 3, "stop_sequences": ["END"],
            "metadata": {"user_id": "u1"}, "tools": [MODE], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "system": [{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}], "seed": 4,
            "messages": [
                {"role": "user", "content": "light"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                                  {"type": "text", "text": "ok"},
                                                  {"type": "tool_use", "id": "t1", "name": "set_mode", "input": {"m": 1}},
                                                  {"type": "tool_use", "id": "t2", "name": "set_mode", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "on"},
                                             {"type": "tool_result", "tool_use_id": "t2",
                                              "content": [{"type": "text", "text": "off"}], "is_error": True},
                                             {"type": "text", "text": "and now?"}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t3", "content": "x"}]}]}
    assert chat_body(body) == {
        "model": "m", "max_tokens": 9, "temperature": 0.5, "top_k": 3, "seed": 4, "stop": ["END"], "user": "u1",
        "prompt_cache_key": "u1",
        "tools": [{"type": "function", "function": {"name": "set_mode", "parameters": {"type": "object"},
                                                    "description": "on or off"}}],
        "tool_choice": "required", "parallel_tool_calls": False,
        "messages": [
            {"role": "system", "content": "be brief"}, {"role": "user", "content": "light"},
            {"role": "assistant", "content": "ok", "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "set_mode", "arguments": '{"m": 1}'}},
                {"id": "t2", "type": "function", "function": {"name": "set_mode", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "t1", "content": "on"}, {"role": "tool", "tool_call_id": "t2", "content": "Error: off"},
            {"role": "user", "content": "and now?"},
            {"role": "tool", "tool_call_id": "t3", "content": "x"}]}  # a turn of tool results alone is those
    started = chat_body({"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"},
                                                                    {"role": "assistant", "content": "Well,"}]})
    assert (started["continue_final_message"], started["add_generation_prompt"]) == (True, False)
    keyed = chat_body({**body, "prompt_cache_key": "session-2"})
    assert (keyed["user"], keyed["prompt_cache_key"]) == ("u1", "session-2")  # a key given wins
    counted = chat_body({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, counting=True)
    assert counted == {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("thinking,config,effort", [
    ({"type": "disabled"}, None, "none"), ({"type": "enabled", "budget_tokens": 2048}, None, "medium"),
    ({"type": "adaptive"}, {"effort": "max"}, "xhigh"), (None, {"effort": "low"}, "low"), (None, None, None),
])
def test_thinking_and_effort_are_chats_reasoning_effort(thinking, config, effort):
    body = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    body |= {k: v for k, v in (("thinking", thinking), ("output_config", config)) if v is not None}
    assert chat_body(body).get("reasoning_effort") == effort


def test_an_output_format_is_chats_json_schema():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}],
            "output_config": {"format": {"type": "json_schema", "schema": schema}}}
    assert chat_body(body)["response_format"] == {"type": "json_schema", "json_schema": {"name": "output",
                                                                                         "schema": schema}}


def replay(events: list[dict]) -> dict:
    """The message a client builds from the events alone, as Anthropic's SDK does."""
    message = None
    arguments: dict[int, str] = {}
    for e in events:
        if e["type"] == "message_start":
            message = json.loads(json.dumps(e["message"]))
        elif e["type"] == "content_block_start":
            assert e["index"] == len(message["content"])
            message["content"].append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta":
            block, delta = message["content"][e["index"]], e["delta"]
            if delta["type"] == "input_json_delta":
                arguments[e["index"]] = arguments.get(e["index"], "") + delta["partial_json"]
            else:
                kind = delta["type"].removesuffix("_delta")
                block[kind] += delta[kind]
        elif e["type"] == "content_block_stop" and e["index"] in arguments:
            message["content"][e["index"]]["input"] = json.loads(arguments[e["index"]])
        elif e["type"] == "message_delta":
            message.update(e["delta"])
            message["usage"].update(e["usage"])
    return message


def test_thinking_text_and_calls_become_blocks_whose_events_give_the_whole():
    stream = MessageStream("r1", "m", {}, prompt_tokens=5)
    events = stream.start()
    assert events[0]["message"]["usage"] == {"input_tokens": 5, "output_tokens": 0}
    for part in thinking_text_and_calls():
        events += stream.feed(part)
    events += stream.end()
    whole = stream.response
    assert whole["content"] == [
        {"type": "thinking", "thinking": "think more", "signature": ""}, {"type": "text", "text": "Sure."},
        {"type": "tool_use", "id": "call_a", "name": "set_mode", "input": {"mode": "on"}},
        {"type": "tool_use", "id": "call_b", "name": "set_mode", "input": {}}]
    assert (whole["stop_reason"], whole["stop_sequence"]) == ("tool_use", None)
    assert whole["usage"] == {"input_tokens": 3, "cache_read_input_tokens": 2, "cache_creation_input_tokens": 0,
                              "output_tokens": 7}
    assert replay(events) == whole and [e["type"] for e in events[-2:]] == ["message_delta", "message_stop"]


@pytest.mark.parametrize("finish,stop,reason,sequence", [
    ("length", None, "max_tokens", None), ("stop", None, "end_turn", None), ("stop", "END", "stop_sequence", "END"),
    ("stop", 7, "end_turn", None),  # a stop token id: no stop sequence of the request's
])
def test_the_stop_reason_says_why_it_stopped(finish, stop, reason, sequence):
    stream = MessageStream("r2", "m", {"stop_sequences": ["END"]}, prompt_tokens=1)
    stream.start()
    stream.feed({"choices": [{"index": 0, "delta": {"content": "abc"}, "finish_reason": finish, "stop_reason": stop}]})
    stream.end()
    assert (stream.response["stop_reason"], stream.response["stop_sequence"]) == (reason, sequence)


@pytest.mark.parametrize("body,named", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"stop_sequences": "END"}, "stop_sequences"), ({"stop_sequences": [""]}, "stop_sequences"),
    ({"metadata": {"user_id": 5}}, "metadata"), ({"metadata": {"tier": "a"}}, "metadata"),
    ({"tools": [{"name": "f", "input_schema": {}, "defer_loading": True}]}, "tools[0].defer_loading"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0]"), ({"tools": {"name": "f"}}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"), ({"thinking": {"type": "on"}}, "thinking"),
    ({"output_config": {"effort": "huge"}}, "output_config.effort"), ({"output_config": {"task_budget": 1}}, "output_config"),
    ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format"),
    ({"service_tier": "priority"}, "service_tier"), ({"mcp_servers": []}, "mcp_servers"),
    ({"messages": []}, "messages"), ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": [{"type": "image"}]}]}]}, "messages[0].content[0]"),
    ({"system": [{"type": "image"}]}, "system"),
])
def test_what_cannot_be_served_is_refused_by_its_own_name(body, named):
    body = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}], **body}
    with pytest.raises(OpenAIError) as err:
        chat_body(body)
    assert err.value.status == 400 and named in err.value.message, err.value.message


def test_a_node_lost_mid_answer_ends_the_stream_with_anthropics_error(tmp_path):
    import aiohttp

    from pdserve.engine.checkpoint import CHAT_TEMPLATE
    from pdserve.router.tokenizer import PromptTokenizer
    from tests.chat_checkpoint import write_tokenizer_only
    from tests.router.fake_worker import openai_router
    from tests.router.test_openai_errors import FailsMidStream

    tokenizer = PromptTokenizer(str(write_tokenizer_only(tmp_path, CHAT_TEMPLATE)), "fake")

    async def post(stream):
        async with openai_router([FailsMidStream("d")], tokenizer) as url, aiohttp.ClientSession() as session:
            async with session.post(f"{url}/v1/messages", json={
                    "model": "fake", "max_tokens": 4, "stream": stream,
                    "messages": [{"role": "user", "content": "hi"}]}) as reply:
                return reply.status, await reply.text()

    status, text = asyncio.run(asyncio.wait_for(post(False), 30))  # nothing sent yet: the error is the answer
    assert status == 500 and json.loads(text)["error"] == {"type": "api_error", "message": "decode node crashed"}
    status, text = asyncio.run(asyncio.wait_for(post(True), 30))
    blocks = [block.split("\n", 1) for block in text.strip().split("\n\n")]
    assert all(name == f"event: {json.loads(data.removeprefix('data: '))['type']}" for name, data in blocks)
    events = [json.loads(data.removeprefix("data: ")) for _, data in blocks]
    assert [e["type"] for e in events] == ["message_start", "content_block_start", "content_block_delta", "error"]
    assert events[2]["delta"] == {"type": "text_delta", "text": "<5>"}
    assert events[-1]["error"] == {"type": "api_error", "message": "decode node crashed"}


blocks = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image", "thinking"])},
                          optional={"text": st.one_of(st.text(max_size=5), json_values)}),
    st.fixed_dictionaries({"type": st.just("tool_use")}, optional={
        "id": st.one_of(st.just("t1"), json_values), "name": st.one_of(st.just("f"), json_values),
        "input": json_values}),
    st.fixed_dictionaries({"type": st.just("tool_result")}, optional={
        "tool_use_id": st.one_of(st.just("t1"), json_values), "content": st.one_of(st.text(max_size=5), json_values)}),
    json_values)
turns = st.one_of(st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "assistant", "system"]),
                                                           json_values)},
                                        optional={"content": st.one_of(st.text(max_size=8), st.lists(blocks, max_size=3),
                                                                       json_values)}), json_values)
bodies = st.fixed_dictionaries({"messages": st.one_of(st.lists(turns, max_size=3), json_values)}, optional={
    "max_tokens": st.one_of(st.integers(-1, 8), json_values), "system": st.one_of(st.text(max_size=6), json_values),
    "stop_sequences": st.one_of(st.lists(st.text(max_size=3), max_size=2), json_values),
    "tools": st.one_of(st.lists(st.one_of(st.fixed_dictionaries({"name": st.sampled_from(["f", "bad name"]),
                                                                 "input_schema": st.just({"type": "object"})}),
                                          json_values), max_size=2), json_values),
    "tool_choice": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none", "x"])},
                                                   optional={"name": st.sampled_from(["f", "g"])}), json_values),
    "thinking": json_values, "metadata": json_values, "stream": st.booleans(),
    "temperature": st.one_of(st.floats(-1, 3), json_values), "top_k": json_values, "output_config": json_values})
fine_bodies = st.fixed_dictionaries({"max_tokens": st.integers(1, 8), "messages": st.lists(
    st.fixed_dictionaries({"role": st.just("user"), "content": st.text(min_size=1, max_size=8)}), min_size=1,
    max_size=2)}, optional={"system": st.text(max_size=6), "stream": st.booleans(),
                            "stop_sequences": st.lists(st.text(min_size=1, max_size=3), max_size=2),
                            "tools": st.just([{"name": "f", "input_schema": {"type": "object"}}]),
                            "tool_choice": st.sampled_from([{"type": t} for t in ("auto", "any", "none")])})


def test_any_messages_body_is_an_answer_or_anthropics_400(tmp_path):
    """Random bodies to /v1/messages of an in-process router over a fake decode node: each
    is a well-formed message (whole, or events ending with message_stop) or a 400 in
    Anthropic's shape, never a 500."""
    from tests.router.fake_worker import posting_to

    answered = []

    @settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
    @given(body=st.one_of(fine_bodies, bodies))
    def check(body):
        status, text = post(body)
        if status == 400:
            error = json.loads(text)
            assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
            return
        assert status == 200, (status, text, body)
        if body.get("stream"):
            events = [json.loads(block.split("\ndata: ", 1)[1]) for block in text.strip().split("\n\n")]
            assert events[-1]["type"] == "message_stop"
            whole = replay(events)
        else:
            whole = json.loads(text)
        assert whole["type"] == "message" and whole["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence",
                                                                       "tool_use"), whole
        answered.append(whole)

    with posting_to(tmp_path, "/v1/messages") as post:
        check()
    assert len(answered) > 30  # the fine bodies are served


def test_anthropic_clients_list_the_model_in_their_own_shape_and_openai_clients_in_theirs():
    import anthropic
    import openai

    from tests.router.fake_worker import FakeWorker, openai_router, run

    async def go():
        async with openai_router([FakeWorker("d")]) as url:
            claude = anthropic.AsyncAnthropic(base_url=url, api_key="none", max_retries=0)
            listed = [m async for m in claude.models.list()]
            one = await claude.models.retrieve("fake")
            with pytest.raises(anthropic.NotFoundError) as missing:
                await claude.models.retrieve("other")
            with pytest.raises(anthropic.BadRequestError) as bad_limit:
                await claude.models.list(limit=0)
            past = [m async for m in claude.models.list(after_id="fake")]
            gpt = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            return listed, one, missing.value, bad_limit.value, past, [m async for m in gpt.models.list()]

    listed, one, missing, bad_limit, past, openai_listed = run(go())
    assert listed == [one] and one.id == "fake" and one.type == "model" and one.lifecycle == "active"
    assert one.display_name == "fake" and one.max_input_tokens == one.max_tokens == 128
    assert one.created_at.tzinfo is not None
    assert missing.body["error"]["type"] == "not_found_error" and "`other` does not exist" in missing.message
    assert "limit" in bad_limit.message and past == []
    assert [(m.id, m.object, m.owned_by) for m in openai_listed] == [("fake", "model", "pdserve")]


def test_every_served_name_is_listed_and_taken_and_answers_give_the_first():
    import dataclasses

    import anthropic
    import openai

    from tests.router.fake_worker import CharTokenizer, FakeWorker, openai_router, run

    class Named(CharTokenizer):  # --served-model-name fake sonnet mini
        card = dataclasses.replace(CharTokenizer.card, aliases=("sonnet", "mini"))

    async def go():
        async with openai_router([FakeWorker("d")], Named()) as url:
            claude = anthropic.AsyncAnthropic(base_url=url, api_key="none", max_retries=0)
            first = await claude.models.list(limit=2)
            after = await claude.models.list(after_id="sonnet")
            before = await claude.models.list(before_id="mini", limit=1)
            gpt = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            listed = [m.id async for m in gpt.models.list()]
            answer = await gpt.completions.create(model="mini", prompt="hi", max_tokens=2)
            with pytest.raises(openai.NotFoundError) as missing:
                await gpt.models.retrieve("haiku")
            return first, after, before, listed, answer, missing.value

    first, after, before, listed, answer, missing = run(go())
    assert [m.id for m in first.data] == ["fake", "sonnet"] and first.has_more and first.last_id == "sonnet"
    assert [m.id for m in after.data] == ["mini"] and not after.has_more
    assert [m.id for m in before.data] == ["sonnet"] and before.has_more
    assert listed == ["fake", "sonnet", "mini"] and answer.model == "fake"
    assert "`fake`, `sonnet`, `mini`" in missing.message

"""The Responses API's parts at the router (router/responses_api.py), no model running: a
request maps to the chat request it means; a chat answer's chunks (reasoning, text, calls)
become output items whose events, replayed, give the whole response; and a failure after
the start ends the stream with OpenAI's error and a failed response."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.router.openai_protocol import OpenAIError
from pdserve.router.responses_api import ResponseStream, chat_body, renamed

MODE = {"type": "function", "name": "set_mode", "parameters": {"type": "object"}}


def test_a_request_is_the_chat_request_it_means():
    body = {"model": "m", "instructions": "be brief", "max_output_tokens": 9, "temperature": 0.5, "top_k": 3,
            "safety_identifier": "u1", "store": True, "metadata": {"k": "v"}, "tools": [MODE],
            "tool_choice": {"type": "function", "name": "set_mode"},
            "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}}},
            "input": [{"role": "developer", "content": "use tools"},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "light"}]},
                      {"type": "reasoning", "id": "rs_1", "summary": []},
                      {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
                      {"type": "function_call", "call_id": "c1", "name": "set_mode", "arguments": "{}"},
                      {"type": "function_call", "call_id": "c2", "name": "set_mode", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "c1", "output": "on"}]}
    chat = chat_body(body)
    assert chat == {
        "model": "m", "temperature": 0.5, "top_k": 3, "user": "u1", "max_completion_tokens": 9,
        "response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": {"type": "object"}}},
        "tools": [{"type": "function", "function": {"name": "set_mode", "parameters": {"type": "object"}}}],
        "tool_choice": {"type": "function", "function": {"name": "set_mode"}},
        "messages": [
            {"role": "system", "content": "be brief"}, {"role": "system", "content": "use tools"},
            {"role": "user", "content": "light"},
            {"role": "assistant", "content": "ok", "tool_calls": [  # one answer's text and calls: one turn
                {"id": "c1", "type": "function", "function": {"name": "set_mode", "arguments": "{}"}},
                {"id": "c2", "type": "function", "function": {"name": "set_mode", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "on"}]}
    assert chat_body({"model": "m", "input": "hi", "tool_choice": "required"})["tool_choice"] == "required"
    # what asks for nothing (nulls, as some clients send every field) is no refusal
    quiet = chat_body({"model": "m", "input": "hi", "reasoning": {"effort": None}, "top_logprobs": None,
                       "max_tool_calls": None, "include": [], "truncation": "disabled"})
    assert quiet == {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_reasoning_effort_is_chats_and_no_summary_is_written():
    body = {"model": "m", "input": "hi", "reasoning": {"effort": "low", "summary": None}}
    assert chat_body(body)["reasoning_effort"] == "low"
    assert ResponseStream("r", "m", body).response["reasoning"] == {"effort": "low", "summary": None}
    chat_check = renamed(OpenAIError(400, "reasoning_effort 'max' must be ...", "reasoning_effort"))
    assert (chat_check.param, chat_check.message) == ("reasoning.effort", "reasoning.effort 'max' must be ...")


@pytest.mark.parametrize("body,param,named", [
    ({"prompt": {"id": "p1"}}, "prompt", "not served"),
    ({"conversation": "c1", "previous_response_id": "r1"}, "conversation", "send one"),
    ({"store": "yes"}, "store", "must be a boolean"),
    ({"stream_options": {"include_usage": True}, "stream": True}, "stream_options", "include_obfuscation"),
    ({"stream_options": {"include_obfuscation": True}}, "stream_options", "with stream: true"),
    ({"reasoning": {"effort": "low", "summary": "auto"}}, "reasoning", "writes no summary"),
    ({"reasoning": "low"}, "reasoning", '{"effort": ...}'),
    ({"reasoning_effort": "low"}, "reasoning_effort", "reasoning.effort"),
    ({"background": True, "store": False}, "background", "store true"),
    ({"background": "yes"}, "background", "must be a boolean"),
    ({"max_tokens": 5}, "max_tokens", "max_output_tokens"),
    ({"n": 2}, "n", "one request"),
    ({"include": ["file_search_call.results"]}, "include", "file_search_call.results"),
    ({"logprobs": True}, "logprobs", "top_logprobs or include"),
    ({"truncation": "middle"}, "truncation", "'middle'"),
    ({"text": {"verbosity": "low"}}, "text", "text.verbosity only at its default"),
    ({"text": {"format": {"type": "text"}, "style": 1}}, "text", "text.format alone"),
    ({"tools": [{"type": "file_search"}]}, "tools", "'file_search'"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "input[0]"),
    ({"input": 5}, "input", "5"),
])
def test_what_cannot_be_served_is_refused_by_its_own_name(body, param, named):
    with pytest.raises(OpenAIError) as err:
        chat_body({"model": "m", "input": "hi", **body})
    assert (err.value.status, err.value.param) == (400, param) and named in err.value.message
    assert renamed(err.value).param == param  # its own name stays
    chat_check = renamed(OpenAIError(400, "max_tokens must be an integer >= 1, got 0", "max_tokens"))
    assert (chat_check.param, chat_check.message) == ("max_output_tokens", "max_output_tokens must be an "
                                                                           "integer >= 1, got 0")


def chunk(delta: dict | None = None, finish=None, usage=None) -> dict:
    return {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}] if delta is not None else [],
            "usage": usage}


def thinking_text_and_calls() -> list[dict]:
    """A chat answer's chunks: reasoning, text, a call whose arguments come in two pieces,
    a second call, then the usage (5 prompt tokens, 2 of them cached, and 7 generated)."""
    return [chunk({"role": "assistant", "content": ""}), chunk({"reasoning_content": "think"}),
            chunk({"reasoning_content": " more"}), chunk({"content": "Sure."}),
            chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                   "function": {"name": "set_mode", "arguments": '{"mode"'}}]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": ': "on"}'}}]}),
            chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                                   "function": {"name": "set_mode", "arguments": "{}"}}]}, "tool_calls"),
            chunk(None, usage={"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
                               "prompt_tokens_details": {"cached_tokens": 2}})]


def replay(events: list[dict]) -> dict:
    """The response a client builds from the events alone."""
    items: dict[int, dict] = {}
    for e in events:
        if e["type"] == "response.output_item.added":
            items[e["output_index"]] = {**e["item"], "content": []} if "content" in e["item"] else dict(e["item"])
        elif e["type"] == "response.content_part.added":
            items[e["output_index"]]["content"].append(dict(e["part"]))
        elif e["type"] in ("response.output_text.delta", "response.reasoning_text.delta"):
            items[e["output_index"]]["content"][e["content_index"]]["text"] += e["delta"]
        elif e["type"] == "response.function_call_arguments.delta":
            items[e["output_index"]]["arguments"] += e["delta"]
        elif e["type"] == "response.output_item.done":
            assert items[e["output_index"]] == {**e["item"], "status": items[e["output_index"]]["status"]}
            items[e["output_index"]]["status"] = e["item"]["status"]
    return {"output": [items[i] for i in sorted(items)], "status": events[-1]["response"]["status"]}


def test_reasoning_text_and_calls_become_items_whose_events_give_the_whole():
    stream = ResponseStream("r1", "m", {"input": "hi", "metadata": {"k": "v"}})
    events = stream.start()
    assert events[0]["response"]["output"] == [] and events[0]["response"]["status"] == "in_progress"
    for part in thinking_text_and_calls():
        events += stream.feed(part)
    events += stream.end()
    whole = stream.response
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [(i["type"], i["status"]) for i in whole["output"]] == [
        ("reasoning", "completed"), ("message", "completed"), ("function_call", "completed"),
        ("function_call", "completed")]
    assert whole["output"][0]["content"][0]["text"] == "think more"
    assert whole["output"][1]["content"][0] == {"type": "output_text", "text": "Sure.", "annotations": []}
    assert [(c["call_id"], c["arguments"]) for c in whole["output"][2:]] == [("call_a", '{"mode": "on"}'),
                                                                            ("call_b", "{}")]
    assert whole["status"] == "completed" and whole["metadata"] == {"k": "v"}
    assert whole["usage"]["input_tokens_details"] == {"cached_tokens": 2} and whole["usage"]["output_tokens"] == 7
    assert replay(events) == {"output": whole["output"], "status": "completed"}
    assert events[-1] == {"type": "response.completed", "sequence_number": len(events) - 1, "response": whole}


def test_the_texts_logprobs_go_with_its_deltas_and_part_when_asked():
    assert chat_body({"model": "m", "input": "hi", "include": ["message.output_text.logprobs"]})["top_logprobs"] == 0
    assert chat_body({"model": "m", "input": "hi", "top_logprobs": 3})["logprobs"] is True
    stream = ResponseStream("r4", "m", {"input": "hi"})
    entry = {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}
    events = stream.start() + stream.feed({"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": "stop",
                                                        "logprobs": {"content": [entry]}}], "usage": None})
    assert events[-1]["type"] == "response.output_text.delta" and events[-1]["logprobs"] == [entry]
    stream.end()
    assert stream.response["output"][0]["content"][0]["logprobs"] == [entry]


def test_an_answer_cut_short_is_incomplete_and_a_failure_ends_the_stream():
    stream = ResponseStream("r2", "m", {"input": "hi"})
    events = stream.start() + stream.feed(chunk({"content": "abc"}, "length")) + stream.end()
    assert stream.response["status"] == "incomplete" and stream.response["output"][0]["status"] == "incomplete"
    assert stream.response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert replay(events)["output"] == stream.response["output"]
    failing = ResponseStream("r3", "m", {"input": "hi"})
    failing.start(), failing.feed(chunk({"content": "a"}))
    last = failing.failed(OpenAIError(503, "decode node lost", None, "unavailable"))
    assert [e["type"] for e in last] == ["error", "response.failed"] and last[0]["message"] == "decode node lost"
    assert last[1]["response"]["error"] == {"code": "unavailable", "message": "decode node lost"}


@pytest.mark.parametrize("stream", [False, True])
def test_a_node_lost_mid_answer_fails_the_response_with_its_error(tmp_path, stream):
    """Over a fake decode node that dies after its first token (in-process router); the
    stream asks for obfuscation, which pads its delta events alone."""
    import asyncio
    import json

    import aiohttp

    from pdserve.engine.checkpoint import CHAT_TEMPLATE
    from pdserve.router.tokenizer import PromptTokenizer
    from tests.chat_checkpoint import write_tokenizer_only
    from tests.router.fake_worker import openai_router
    from tests.router.test_openai_errors import FailsMidStream

    tokenizer = PromptTokenizer(str(write_tokenizer_only(tmp_path, CHAT_TEMPLATE)), "fake")

    async def post():
        async with openai_router([FailsMidStream("d")], tokenizer) as url, aiohttp.ClientSession() as session:
            async with session.post(f"{url}/v1/responses",
                                    json={"model": "fake", "input": "hi", "stream": stream, **(
                                        {"stream_options": {"include_obfuscation": True}} if stream else {})}) as reply:
                return reply.status, await reply.text()

    status, text = asyncio.run(asyncio.wait_for(post(), 30))
    if not stream:  # nothing was sent yet: the error is the answer
        assert status == 500 and json.loads(text)["error"]["message"].endswith("decode node crashed")
        return
    events = [json.loads(block.split("\ndata: ", 1)[1]) for block in text.strip().split("\n\n")]
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "error", "response.failed"]
    assert events[4]["delta"] == "<5>" and events[5]["code"] == "internal"
    padded = [block.split("\ndata: ", 1)[1] for block in text.strip().split("\n\n") if '"obfuscation"' in block]
    assert len(padded) == 1 and json.loads(padded[0])["type"] == "response.output_text.delta"
    assert len(padded[0]) % 128 == 0
    assert events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["error"]["message"].endswith("decode node crashed")


json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.text(max_size=6)),
                           lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                   st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                           max_leaves=8)
parts = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "input_image"]),
                                        "text": st.one_of(st.text(max_size=5), json_values)}), max_size=2)
items = st.one_of(
    st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "developer", "assistant"]),
                                             json_values)},
                          optional={"type": st.sampled_from(["message", "other"]),
                                    "content": st.one_of(st.text(max_size=8), parts, json_values)}),
    st.fixed_dictionaries({"type": st.just("function_call")}, optional={
        "call_id": st.one_of(st.text(max_size=4), json_values), "name": st.one_of(st.just("f"), json_values),
        "arguments": st.one_of(st.sampled_from(["{}", "{", ""]), json_values)}),
    st.fixed_dictionaries({"type": st.just("function_call_output")}, optional={
        "call_id": st.one_of(st.text(max_size=4), json_values), "output": st.one_of(st.text(max_size=5), json_values)}),
    st.fixed_dictionaries({"type": st.just("reasoning")}), json_values)
bodies = st.fixed_dictionaries({"input": st.one_of(st.text(max_size=12), st.lists(items, max_size=4), json_values)},
                               optional={
    "instructions": st.one_of(st.text(max_size=8), json_values),
    "max_output_tokens": st.one_of(st.integers(-2, 40), json_values),
    "tools": st.one_of(st.lists(st.one_of(st.fixed_dictionaries({
        "type": st.just("function"), "name": st.sampled_from(["f", "g", "bad name"])}), json_values), max_size=2),
        json_values),
    "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required"]), json_values, st.fixed_dictionaries(
        {"type": st.just("function"), "name": st.sampled_from(["f", "x"])})),
    "text": st.one_of(json_values, st.fixed_dictionaries({"format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "yaml"])},
        optional={"schema": json_values, "name": st.text(max_size=4)})})),
    "stream": st.booleans(), "temperature": st.one_of(st.floats(-1, 3), json_values),
    "previous_response_id": st.one_of(st.none(), st.text(max_size=3)), "reasoning": json_values,
    "include": json_values, "store": json_values, "metadata": json_values, "n": json_values})
fine_items = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "developer", "assistant"]),
                           "content": st.one_of(st.text(max_size=8), parts.filter(
                               lambda ps: all(p["type"] != "input_image" and isinstance(p["text"], str)
                                              for p in ps)))}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.just("c1"), "name": st.just("f"),
                           "arguments": st.just("{}")}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.just("c1"),
                           "output": st.text(max_size=5)}))
fine_bodies = st.fixed_dictionaries({"input": st.one_of(st.text(min_size=1, max_size=12),
                                                        st.lists(fine_items, min_size=1, max_size=3))}, optional={
    "instructions": st.text(max_size=8), "max_output_tokens": st.integers(1, 8), "stream": st.booleans(),
    "tools": st.just([{"type": "function", "name": "f"}]),
    "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "name": "f"}]),
    "text": st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}}]),
    "metadata": st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2)})


def test_any_responses_body_is_an_answer_or_a_400_naming_a_field_it_sent(tmp_path):
    """Random bodies to /v1/responses of an in-process router over a fake decode node, most
    of the fine ones served, most of the others refused: every one is a well-formed response
    (whole, or events ending it) or a 400 whose `param` is a field of the body, never a 500."""
    import json

    from tests.router.fake_worker import posting_to

    @settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
    @given(body=st.one_of(fine_bodies, bodies))
    def check(body):
        status, text = post(body)
        if status in (400, 404):  # 404: a previous_response_id never stored
            param = json.loads(text)["error"]["param"]
            assert param and param.split(".")[0].split("[")[0] in {"model", *body}, (param, body)
            return
        assert status == 200, (status, text, body)
        if body.get("stream"):
            events = [json.loads(block.split("\ndata: ", 1)[1]) for block in text.strip().split("\n\n")]
            assert [e["sequence_number"] for e in events] == list(range(len(events)))
            whole = events[-1]["response"]
        else:
            whole = json.loads(text)
        assert whole["object"] == "response" and whole["status"] in ("completed", "incomplete"), whole

    with posting_to(tmp_path, "/v1/responses") as post:
        check()

"""Anthropic's Messages API on a running router (router/anthropic_api.py), through the
official `anthropic` client: the text is what transformers' greedy `generate` writes for
the conversation's chat prompt, streamed or whole; a stop sequence, a forced tool and an
answer's given beginning come back as Anthropic says; count_tokens counts what a message
sends; what pdserve cannot serve is Anthropic's 400 naming it, and the decode pool is full
again afterwards."""

from __future__ import annotations

import json

import anthropic
import pytest

from tests.cluster.nodes import sample, wait_until
from tests.cluster.test_openai_api import _post
from tests.cluster.test_responses_api import CHAT_MODE, MESSAGES, want  # noqa: F401  (a fixture)

GREEDY = dict(max_tokens=6, extra_body={"temperature": 0.0, "ignore_eos": True})
MODE = {"name": "set_mode", "description": "Turn the light on or off",
        "input_schema": {"type": "object", "properties": {"mode": {"enum": ["on", "off"]}}, "required": ["mode"]}}


@pytest.fixture(scope="module")
def claude(cluster):
    """The official `anthropic` client on the `cluster` router's HTTP API."""
    client = anthropic.Anthropic(base_url=cluster.http, api_key="unused", max_retries=0, timeout=60)
    yield client
    client.close()


def test_a_message_is_what_transformers_writes_streamed_or_whole(claude, cluster, want):
    text, prompt_tokens = want
    fox = [{"role": "user", "content": "name a fox"}]
    whole = claude.messages.create(model=cluster.model, system="be brief", messages=fox, **GREEDY)
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text == text
    assert (whole.stop_reason, whole.stop_sequence) == ("max_tokens", None)
    usage = whole.usage
    assert (usage.input_tokens + usage.cache_read_input_tokens, usage.output_tokens) == (prompt_tokens, 6)
    assert whole.id.startswith("msg_") and whole.role == "assistant" and whole.model == cluster.model

    with claude.messages.stream(model=cluster.model, system=[{"type": "text", "text": "be brief"}], messages=[
            {"role": "user", "content": [{"type": "text", "text": "name a fox", "cache_control": {"type": "ephemeral"}}]}],
            **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type not in ("text",)]  # "text": the helper's own, beside each delta
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == text
    assert final.content[0].text == text and final.stop_reason == "max_tokens" and final.usage.output_tokens == 6


def test_a_stop_sequence_ends_the_text_and_is_named(claude, cluster, want):
    text, _ = want
    stop = text[2:5]
    out = claude.messages.create(model=cluster.model, system="be brief", messages=[
        {"role": "user", "content": "name a fox"}], stop_sequences=["\x00never", stop], **GREEDY)
    assert out.content[0].text == text[:text.index(stop)]
    assert (out.stop_reason, out.stop_sequence) == ("stop_sequence", stop)


def test_a_forced_tool_is_the_call_chat_makes_and_its_result_goes_back_in(claude, api, cluster):
    ask = [{"role": "user", "content": "the light, please"}]
    named = claude.messages.create(model=cluster.model, messages=ask, tools=[MODE], max_tokens=24,
                                   tool_choice={"type": "tool", "name": "set_mode"}, extra_body={"temperature": 0.0})
    chat = api.chat.completions.create(model=cluster.model, messages=ask, temperature=0.0, max_tokens=24,
                                       tools=[CHAT_MODE], tool_choice={"type": "function", "function": {"name": "set_mode"}})
    [call] = named.content
    [chat_call] = chat.choices[0].message.tool_calls
    assert (call.type, call.name, call.input) == ("tool_use", "set_mode", json.loads(chat_call.function.arguments))
    assert call.input["mode"] in ("on", "off") and named.stop_reason == "tool_use"

    history = [*ask, {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name,
                                                          "input": call.input}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "done"}]}]
    # "none": the tools stay out of the prompt, which the tiny model's context could not hold twice
    after = claude.messages.create(model=cluster.model, messages=history, tools=[MODE], tool_choice={"type": "none"},
                                   **GREEDY)
    as_chat = api.chat.completions.create(model=cluster.model, temperature=0.0, max_tokens=6, messages=[
        *ask, {"role": "assistant", "content": None, "tool_calls": [chat_call.model_dump()]},
        {"role": "tool", "tool_call_id": chat_call.id, "content": "done"}], tools=[CHAT_MODE],
        tool_choice="none", extra_body={"ignore_eos": True})
    assert after.usage.input_tokens + after.usage.cache_read_input_tokens == as_chat.usage.prompt_tokens
    assert after.content[0].text == as_chat.choices[0].message.content
    counted = claude.messages.count_tokens(model=cluster.model, messages=history, tools=[MODE],
                                           tool_choice={"type": "none"})
    assert counted.input_tokens == as_chat.usage.prompt_tokens


def test_an_answers_given_beginning_is_continued(claude, api, cluster):
    conversation = [{"role": "user", "content": "name a fox"}, {"role": "assistant", "content": "The fox is"}]
    out = claude.messages.create(model=cluster.model, messages=conversation, **GREEDY)
    chat = api.chat.completions.create(model=cluster.model, messages=conversation, temperature=0.0, max_tokens=6,
                                       extra_body={"ignore_eos": True, "continue_final_message": True,
                                                   "add_generation_prompt": False})
    assert out.content[0].text == chat.choices[0].message.content and out.usage.output_tokens == 6


@pytest.mark.parametrize("body,named", [
    ({"messages": MESSAGES[1:]}, "max_tokens"),
    ({"messages": MESSAGES, "max_tokens": 4}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 4},
     "messages[0].content[0]"),
    ({"messages": MESSAGES[1:], "max_tokens": 4, "tools": [{"type": "web_search_20250305", "name": "w"}]},
     "tools[0]"),
    ({"messages": MESSAGES[1:], "max_tokens": 4, "container": "c1"}, "container"),
    ({"messages": MESSAGES[1:], "max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": 0}},
     "thinking.budget_tokens"),
])
def test_what_cannot_be_served_is_anthropics_400_naming_it_and_no_page_is_kept(cluster, body, named):
    status, reply = _post(cluster.http + "/v1/messages", json.dumps({"model": cluster.model, **body}).encode())
    assert status == 400 and reply["type"] == "error", reply
    assert reply["error"]["type"] == "invalid_request_error" and named in reply["error"]["message"], reply
    wait_until(lambda: sample(cluster.scrape("decode"), "pdserve_kv_pages_used", role="decode") == 0,
               "every decode page free", 15)


def test_the_sdks_errors_are_anthropics(claude, cluster):
    with pytest.raises(anthropic.NotFoundError) as err:
        claude.messages.create(model="no-such-model", messages=MESSAGES[1:], max_tokens=4)
    assert err.value.body["error"]["type"] == "not_found_error" and "no-such-model" in err.value.message
    with pytest.raises(anthropic.BadRequestError) as err:  # the context's own check, as chat's
        claude.messages.create(model=cluster.model, messages=MESSAGES[1:], max_tokens=10**6)
    assert "maximum context length" in err.value.message

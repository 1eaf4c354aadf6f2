"""OpenAI's Responses API on a running router (router/responses_api.py), through the
official `openai` client: the text is what transformers' greedy `generate` writes for the
conversation's chat prompt, streamed or whole; a forced function comes back as the same
call chat completions make, and its output goes back in as input; a request pdserve cannot
serve is a 400 naming the field, and the decode pool is full again afterwards."""

from __future__ import annotations

import json

import pytest

from pdserve.benchmarks.constrained import transformers_greedy
from pdserve.router.tokenizer import PromptTokenizer
from tests.cluster.nodes import sample, wait_until
from tests.cluster.test_openai_api import _post

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name a fox"}]
GREEDY = dict(temperature=0.0, max_output_tokens=6, extra_body={"ignore_eos": True})
MODE = {"type": "function", "name": "set_mode", "description": "Turn the light on or off",
        "parameters": {"type": "object", "properties": {"mode": {"enum": ["on", "off"]}}, "required": ["mode"]}}
CHAT_MODE = {"type": "function", "function": {k: v for k, v in MODE.items() if k != "type"}}  # chat's shape


@pytest.fixture(scope="module")
def want(tiny_model) -> tuple[str, int]:
    """(text, prompt tokens): transformers' 6 greedy tokens after MESSAGES' chat prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = PromptTokenizer(tiny_model).chat_ids(MESSAGES)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    ids = transformers_greedy(model, [prompt], 6, 0, eos=False)[0]
    return AutoTokenizer.from_pretrained(tiny_model).decode(ids, skip_special_tokens=True), len(prompt)


def test_a_response_is_what_transformers_writes_streamed_or_whole(api, cluster, want):
    text, prompt_tokens = want
    whole = api.responses.create(model=cluster.model, instructions="be brief", input="name a fox", **GREEDY)
    assert whole.output_text == text and [item.type for item in whole.output] == ["message"]
    assert (whole.status, whole.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (prompt_tokens, 6)
    assert whole.id.startswith("resp_") and whole.output[0].content[0].type == "output_text"

    events = list(api.responses.create(model=cluster.model, input=[
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "name a fox"}]}],
        stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert events[-1].response.output_text == text and events[-1].response.usage.output_tokens == 6


def test_the_texts_logprobs_are_chats(api, cluster):
    asked = api.responses.create(model=cluster.model, input="name a fox", include=["message.output_text.logprobs"],
                                 top_logprobs=2, **GREEDY)
    chat = api.chat.completions.create(model=cluster.model, messages=[{"role": "user", "content": "name a fox"}],
                                       logprobs=True, top_logprobs=2, max_tokens=6, temperature=0.0,
                                       extra_body={"ignore_eos": True})
    got = asked.output[0].content[0].logprobs
    want = chat.choices[0].logprobs.content
    assert [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in got] == \
        [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in want]
    assert "".join(e.token for e in got) == asked.output_text and len(got) == 6


def test_a_forced_function_is_the_call_chat_makes_and_its_output_goes_back_in(api, cluster):
    named = api.responses.create(model=cluster.model, input="the light, please", tools=[MODE], temperature=0.0,
                                 tool_choice={"type": "function", "name": "set_mode"}, max_output_tokens=24)
    chat = api.chat.completions.create(
        model=cluster.model, messages=[{"role": "user", "content": "the light, please"}], temperature=0.0,
        tools=[CHAT_MODE], tool_choice={"type": "function", "function": {"name": "set_mode"}}, max_tokens=24)
    [call] = named.output
    [chat_call] = chat.choices[0].message.tool_calls
    assert (call.type, call.name, call.arguments) == ("function_call", "set_mode", chat_call.function.arguments)
    assert json.loads(call.arguments)["mode"] in ("on", "off") and named.status == "completed"

    history = [{"role": "user", "content": "the light, please"},
               {"type": "function_call", "call_id": call.call_id, "name": "set_mode", "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "done"}]
    # "none": the tools stay out of the prompt, which the tiny model's context could not hold twice
    after = api.responses.create(model=cluster.model, input=history, tools=[MODE], tool_choice="none", **GREEDY)
    as_chat = api.chat.completions.create(model=cluster.model, temperature=0.0, max_tokens=6, messages=[
        history[0], {"role": "assistant", "content": None, "tool_calls": [chat_call.model_dump()]},
        {"role": "tool", "tool_call_id": chat_call.id, "content": "done"}], tools=[CHAT_MODE],
        tool_choice="none", extra_body={"ignore_eos": True})
    assert after.usage.input_tokens == as_chat.usage.prompt_tokens


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "previous_response_id": 5}, "previous_response_id"),  # (an unknown id: 404)
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field_and_no_page_is_kept(cluster, body, param):
    status, reply = _post(cluster.http + "/v1/responses", json.dumps({"model": cluster.model, **body}).encode())
    assert status == 400 and reply["error"]["param"] == param, reply
    assert param in reply["error"]["message"]
    wait_until(lambda: sample(cluster.scrape("decode"), "pdserve_kv_pages_used", role="decode") == 0,
               "every decode page free", 15)


def test_a_router_naming_another_its_peer_reads_and_continues_the_others_responses(api, cluster):
    """`pdserve router --peer-router`: a second router process over the same workers."""
    import openai

    from pdserve.procs import free_port

    port = free_port()
    cluster.start("peer-router", ["router", "--model", cluster.model, "--host", "127.0.0.1", "--http-port", str(port),
                                  "--prefill", cluster.address("prefill"), "--decode", cluster.address("decode"),
                                  "--peer-router", cluster.http.removeprefix("http://")])
    try:
        other = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        first = api.responses.create(model=cluster.model, input="name a fox", **GREEDY)
        assert other.responses.retrieve(first.id).output_text == first.output_text
        followed = other.responses.create(model=cluster.model, input="and a dog", previous_response_id=first.id,
                                          **GREEDY)
        here = api.responses.create(model=cluster.model, input="and a dog", previous_response_id=first.id, **GREEDY)
        assert (followed.output_text, followed.usage.input_tokens) == (here.output_text, here.usage.input_tokens)
    finally:
        cluster.stop_node("peer-router")

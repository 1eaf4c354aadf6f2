"""Tool calling over gRPC (router/grpc_tools.py), through a router over a fake decode node
that writes a Hermes call: the prompt is exactly the one the OpenAI API renders for the same
conversation and tools (a later turn's calls and results included); the answer's text is
its content, streamed without the call's markup, and its calls come parsed on its last
message; bad tools and choices are INVALID_ARGUMENT naming the field and the value; a
forced choice holds the answer to a structure."""

from __future__ import annotations

import json

import grpc
import pytest

from pdserve.client import AsyncClient, PdserveError, ToolCall
from pdserve.engine.checkpoint import CHAT_TEMPLATE
from pdserve.router.openai_protocol import chat_prompt, tools_of
from pdserve.router.tokenizer import PromptTokenizer
from tests.chat_checkpoint import write_tokenizer_only
from tests.router.fake_worker import FakeWorker, run, start_router
from tests.router.test_tools import HISTORY, TOOLS, WEATHER

ANSWER = ["Let me look.", "<tool_call>", '\n{"name": "get_weather", ', '"arguments": {"city": "Paris"}}',
          "\n</tool_call>"]
ASKED = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture
def tokenizer(tmp_path):
    out = write_tokenizer_only(tmp_path, CHAT_TEMPLATE)
    config = json.loads((out / "config.json").read_text())  # room for the tools' system message
    (out / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    return PromptTokenizer(str(out), "fake")


def served(tokenizer, worker, calls):
    """`calls(client)` against a router over `worker`: what it returns."""
    async def go():
        addr, _, stop = await start_router([FakeWorker("p")], [worker], tokenizer=tokenizer)
        try:
            async with AsyncClient(addr) as client:
                return await calls(client)
        finally:
            await stop()
    return run(go())


def sent_prompts(worker) -> list[list[int]]:
    return [list(msg.prompt_token_ids) for rpc, msg in worker.calls if rpc == "PrepareReceive"]


def test_an_answers_call_comes_parsed_and_its_text_streams_without_the_markup(tokenizer):
    worker = FakeWorker("d", texts=ANSWER)

    async def calls(client):
        whole = await client.generate(messages=ASKED, tools=TOOLS, max_tokens=32)
        deltas = [d async for d in client.stream(messages=ASKED, tools=TOOLS, max_tokens=32)]
        # the next turn sends the call and its result back
        history = [*ASKED, {"role": "assistant", "content": whole.text, "tool_calls": whole.tool_calls},
                   {"role": "tool", "tool_call_id": whole.tool_calls[0].id, "content": "sunny"}]
        await client.generate(messages=history, tools=TOOLS, max_tokens=32)
        return whole, deltas, history

    whole, deltas, history = served(tokenizer, worker, calls)
    assert whole.text == "Let me look." and len(whole.tool_calls) == 1
    call = whole.tool_calls[0]
    assert (call.name, call.arguments, call.id != "") == ("get_weather", '{"city": "Paris"}', True)
    assert len(whole.token_ids) == len(ANSWER)  # every token, the call's too
    assert "".join(d.text for d in deltas) == "Let me look." and "<tool_call>" not in "".join(d.text for d in deltas)
    assert [c.name for d in deltas for c in d.tool_calls] == ["get_weather"]
    first, _, second = sent_prompts(worker)
    openai = [{**m, "tool_calls": [{"id": c.id, "type": "function",
                                    "function": {"name": c.name, "arguments": c.arguments}}
                                   for c in m["tool_calls"]]} if "tool_calls" in m else m for m in history]
    offered = tools_of({"tools": TOOLS})
    assert first == chat_prompt({"messages": ASKED}, tokenizer, offered)  # as /v1/chat/completions renders it
    assert second == chat_prompt({"messages": openai}, tokenizer, offered)
    assert "get_weather" in tokenizer.decode(first) and "sunny" in tokenizer.decode(second)


def test_a_forced_call_holds_the_answer_and_none_leaves_the_tools_out(tokenizer):
    worker = FakeWorker("d", texts=['{"city": ', '"Paris"}'])

    async def calls(client):
        forced = await client.generate(messages=ASKED, tools=TOOLS, tool_choice="get_weather", max_tokens=32)
        none = await client.generate(messages=ASKED, tools=TOOLS, tool_choice="none", max_tokens=32)
        return forced, none

    forced, none = served(tokenizer, worker, calls)
    assert forced.text == "" and [(c.name, c.arguments) for c in forced.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')]
    assert none.text == '{"city": "Paris"}' and none.tool_calls == []
    held = [msg.sampling for rpc, msg in worker.calls if rpc == "PrepareReceive"]
    assert held[0].HasField("structured_output") and '"city"' in held[0].structured_output.json_schema
    assert not held[1].HasField("structured_output")
    assert sent_prompts(worker)[1] == chat_prompt({"messages": ASKED}, tokenizer)  # no tools offered


@pytest.mark.parametrize(("kwargs", "named"), [
    (dict(tools=[{"name": "bad name"}]), "tools[0].name must be 1 to 64 letters"),
    (dict(tools=[WEATHER, WEATHER]), "given twice"),
    (dict(tools=[{"name": "f", "parameters": "x"}]), "tools[0].parameters must be a JSON Schema object"),
    (dict(tools=TOOLS, tool_choice="nope"), "tool_choice names function 'nope'"),
    (dict(tool_choice="required"), "tool_choice 'required' needs tools"),
    (dict(tools=TOOLS, tool_choice="required", structured_output={"json_object": True}),
     "cannot also follow sampling.structured_output"),
    (dict(prompt="hi", tools=TOOLS), "send messages, not a prompt"),
])
def test_bad_tools_are_invalid_argument_naming_the_field(tokenizer, kwargs, named):
    worker = FakeWorker("d", texts=ANSWER)
    kwargs = {"messages": ASKED, **kwargs}
    if "prompt" in kwargs:
        del kwargs["messages"]

    async def calls(client):
        with pytest.raises(PdserveError) as err:
            await client.generate(**kwargs, max_tokens=8)
        return err.value

    err = served(tokenizer, worker, calls)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and named in err.details(), err.details()
    assert worker.calls == []  # refused at the front door


def test_parameters_that_are_not_json_are_invalid_argument(tokenizer):
    from pdserve.client import generate_request

    async def calls(client):
        request = generate_request(messages=ASKED, tools=[{"name": "f"}])
        request.tools[0].parameters = "{not json"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in client.stub.Generate(request):
                pass
        return err.value

    err = served(tokenizer, FakeWorker("d"), calls)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tools[0].parameters must be a JSON Schema as JSON text, got '{not json'" in err.details()


def test_the_client_sends_calls_back_as_an_answer_gave_them():
    from pdserve.client import chat_message, tool_of

    given = chat_message({"role": "assistant", "tool_calls": [ToolCall("c1", "f", "{}"),
                                                              {"id": "c2", "function": {"name": "g", "arguments": "[]"}}]})
    assert [(c.id, c.name, c.arguments) for c in given.tool_calls] == [("c1", "f", "{}"), ("c2", "g", "[]")]
    assert not given.HasField("content")
    assert tool_of(WEATHER).parameters.startswith('{"type": "object"') and tool_of({"name": "g"}).parameters == ""

"""Mistral's calls from its v11 tokenizer on (`[TOOL_CALLS]name[ARGS]{...}`, router/
tool_dialects.py): a template that writes `[ARGS]` names the form, for "auto" and for
`--tool-call-parser mistral` alike; the answers read the same in any pieces, after text
too, one call after another, v13's `[CALL_ID]` skipped; such an "auto" request asks its
node to keep the special tokens its markers are (unless it says otherwise, over OpenAI and
gRPC alike), and an OpenAI client gets the calls with Mistral's 9-character ids."""

from __future__ import annotations

import re

import pytest

from pdserve.proto import pdserve_pb2
from pdserve.router.grpc_tools import held_to
from pdserve.router.openai_protocol import sampling_from_body
from pdserve.router.tokenizer import PromptTokenizer
from pdserve.router.tool_dialects import DIALECTS, HERMES, MISTRAL_V11, dialect_of
from tests.chat_checkpoint import write_tokenizer_only
from tests.router.fake_worker import FakeWorker, openai_router, run
from tests.router.test_tools import MISTRAL_TEMPLATE, TOOLS, answer, tools

# An excerpt of Mistral Small 3.2's template: the lines that write tools and calls.
V11_TEMPLATE = ("{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
                "{%- for m in messages %}{%- if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
                "{%- elif m.tool_calls is defined %}{%- for c in m.tool_calls %}[TOOL_CALLS]"
                "{{ c.function.name }}[ARGS]{{ c.function.arguments }}{%- endfor %}"
                "{%- else %}{{ m.content }}{%- endif %}{%- endfor %}")

WEATHER, TIME = ("get_weather", '{"city": "Paris"}'), ("get_time", "{}")
ANSWERS = [
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}', "", [WEATHER, TIME],
     "tool_calls"),
    ("Let me look.[TOOL_CALLS]get_time[ARGS] {} ", "Let me look.", [TIME], "tool_calls"),
    ("[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{}", "", [TIME], "tool_calls"),  # v13
    ("It is sunny, [ARGS] aside.", None, [], "stop"),
    ("[TOOL_CALLS]get_news[ARGS]{}", None, [], "stop"),  # no such tool: the answer is its text
    ("[TOOL_CALLS]get_time{}", None, [], "stop"),
    ("[TOOL_CALLS]get_time[ARGS]{} and then", None, [], "stop"),
    ('[TOOL_CALLS]get_weather[ARGS]["Paris"]', None, [], "stop"),
]


@pytest.mark.parametrize("text,content,calls,finish", ANSWERS)
def test_v11_calls_read_the_same_streamed_in_any_pieces(text, content, calls, finish):
    given = tools(MISTRAL_V11)
    want = (text if content is None else content, calls, finish)
    for cut in range(len(text) + 1):
        assert answer(given, text, [cut]) == want, cut
    assert answer(given, text, list(range(1, len(text)))) == want


def test_a_template_writing_args_names_the_v11_form(tmp_path):
    assert dialect_of(V11_TEMPLATE) is MISTRAL_V11 and dialect_of(MISTRAL_TEMPLATE) is DIALECTS["mistral"]
    v11 = str(write_tokenizer_only(tmp_path / "v11", V11_TEMPLATE))
    older = str(write_tokenizer_only(tmp_path / "v3", MISTRAL_TEMPLATE))
    assert PromptTokenizer(v11).tool_dialect is MISTRAL_V11
    assert PromptTokenizer(v11, tool_call_parser="mistral").tool_dialect is MISTRAL_V11
    assert PromptTokenizer(older, tool_call_parser="mistral").tool_dialect is DIALECTS["mistral"]


def test_an_auto_request_keeps_special_tokens_unless_it_says_otherwise():
    def kept(body: dict, **choice) -> bool | None:
        pb = sampling_from_body({"model": "m", **body}, chat=True, default_max_tokens=8,
                                tools=tools(MISTRAL_V11, **choice))
        return pb.skip_special_tokens if pb.HasField("skip_special_tokens") else None

    assert kept({}) is False and kept({"skip_special_tokens": True}) is True
    assert kept({}, tool_choice="none") is None and kept({}, tool_choice="required") is None
    assert sampling_from_body({"model": "m"}, chat=True, default_max_tokens=8,
                              tools=tools(DIALECTS["mistral"])).HasField("skip_special_tokens") is False
    # gRPC: the same rule over the request's own sampling
    assert held_to(pdserve_pb2.SamplingParams(), tools(MISTRAL_V11)).skip_special_tokens is False
    asked = pdserve_pb2.SamplingParams(skip_special_tokens=True)
    assert held_to(asked, tools(MISTRAL_V11)) is asked
    assert not held_to(pdserve_pb2.SamplingParams(), tools(HERMES)).HasField("skip_special_tokens")


def test_an_openai_client_gets_the_calls_and_the_node_keeps_the_markers(tmp_path):
    import openai

    worker = FakeWorker("d", texts=["[TOOL_CALLS]", "get_weather", "[ARGS]", '{"city": ', '"Paris"}'])

    async def go():
        tokenizer = PromptTokenizer(str(write_tokenizer_only(tmp_path, V11_TEMPLATE)), "fake")
        async with openai_router([worker], tokenizer) as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            return await client.chat.completions.create(
                model="fake", messages=[{"role": "user", "content": "weather in Paris?"}], tools=TOOLS)

    reply = run(go())
    choice = reply.choices[0]
    call = choice.message.tool_calls[0]
    assert (call.function.name, call.function.arguments) == WEATHER and re.fullmatch(r"[0-9a-f]{9}", call.id)
    assert choice.message.content in (None, "")
    sampling = next(request.sampling for name, request in worker.calls if name == "PrepareReceive")
    assert sampling.HasField("skip_special_tokens") and not sampling.skip_special_tokens

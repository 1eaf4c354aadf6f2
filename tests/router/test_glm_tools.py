"""GLM-4.5's calls (`<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>`,
router/tool_dialects.py): a template that writes `<arg_key>` names the form; an answer reads
the same in any pieces, a string parameter's value as written and another's as JSON; a call
that does not parse leaves the answer as text; an "auto" request keeps special tokens (the
markers may be ones), and an OpenAI client gets the calls."""

from __future__ import annotations

import json

import pytest

from pdserve.router.openai_protocol import sampling_from_body
from pdserve.router.tokenizer import PromptTokenizer
from pdserve.router.tool_dialects import GLM45, dialect_of
from pdserve.router.tools import tools_from_body
from tests.chat_checkpoint import write_tokenizer_only
from tests.router.fake_worker import FakeWorker, openai_router, run
from tests.router.test_tools import TOOLS, answer

# An excerpt of GLM-4.5's template: the lines that write an earlier answer's calls.
GLM_TEMPLATE = ("{%- if tools %}<|system|>{{ tools | tojson }}{%- endif %}{%- for m in messages %}<|{{ m.role }}|>"
                "{{ m.content }}{%- for tc in m.tool_calls or [] %}<tool_call>{{ tc.function.name }}"
                "{%- for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key><arg_value>"
                "{{ v | tojson if v is not string else v }}</arg_value>{%- endfor %}</tool_call>{%- endfor %}"
                "{%- endfor %}<|assistant|>")
ROOMS = {"type": "function", "function": {"name": "book", "parameters": {"type": "object", "properties": {
    "room": {"type": "string"}, "nights": {"type": "integer"}, "extras": {"type": "array"}}}}}
GIVEN = tools_from_body({"tools": [*TOOLS, ROOMS]}, GLM45)

ANSWERS = [
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>", "",
     [("get_weather", '{"city": "Paris"}')], "tool_calls"),
    ("Let me check.<tool_call>get_time</tool_call>", "Let me check.", [("get_time", "{}")], "tool_calls"),
    # a string parameter keeps "101" as written; the others read as JSON; two calls one after another
    ('<tool_call>book<arg_key>room</arg_key><arg_value>101</arg_value><arg_key>nights</arg_key><arg_value>2'
     '</arg_value><arg_key>extras</arg_key><arg_value>["late checkout"]</arg_value></tool_call>\n'
     '<tool_call>get_time</tool_call>', "",
     [("book", '{"room": "101", "nights": 2, "extras": ["late checkout"]}'), ("get_time", "{}")], "tool_calls"),
    ("<tool_call>get_news<arg_key>topic</arg_key><arg_value>x</arg_value></tool_call>", None, [], "stop"),
    ("<tool_call>get_weather<arg_key>city</arg_key>Paris</tool_call>", None, [], "stop"),
    ("<tool_call>get_weather stray <arg_key>city</arg_key><arg_value>Paris</arg_value> words</tool_call>", None,
     [], "stop"),
    ("It is sunny.", "It is sunny.", [], "stop"),
]


@pytest.mark.parametrize("text,content,calls,finish", ANSWERS)
def test_glm_calls_read_the_same_streamed_in_any_pieces(text, content, calls, finish):
    want = (text if content is None else content, calls, finish)
    for cut in range(len(text) + 1):
        assert answer(GIVEN, text, [cut]) == want, cut
    assert answer(GIVEN, text, list(range(1, len(text)))) == want


def test_a_template_writing_arg_keys_names_the_glm_form_and_renders_earlier_calls(tmp_path):
    assert dialect_of(GLM_TEMPLATE) is GLM45
    tokenizer = PromptTokenizer(str(write_tokenizer_only(tmp_path, GLM_TEMPLATE)))
    assert tokenizer.tool_dialect is GLM45
    messages = [{"role": "user", "content": "book it"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "book", "arguments": '{"room": "101", "nights": 2}'}}]}]
    text = tokenizer.tokenizer.decode(tokenizer.chat_ids(messages, tools_from_body({"tools": [ROOMS]}, GLM45)))
    assert "<tool_call>book<arg_key>room</arg_key><arg_value>101</arg_value><arg_key>nights</arg_key>" \
           "<arg_value>2</arg_value></tool_call>" in text


def test_an_auto_request_keeps_special_tokens_and_a_client_gets_the_calls(tmp_path):
    import openai

    pb = sampling_from_body({"model": "m"}, chat=True, default_max_tokens=8, tools=GIVEN)
    assert pb.HasField("skip_special_tokens") and not pb.skip_special_tokens
    worker = FakeWorker("d", texts=["<tool_call>", "book", "<arg_key>", "nights", "</arg_key>", "<arg_value>", "3",
                                    "</arg_value>", "</tool_call>"], finish="stop")

    async def go():
        tokenizer = PromptTokenizer(str(write_tokenizer_only(tmp_path, GLM_TEMPLATE)), "fake")
        async with openai_router([worker], tokenizer) as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            return await client.chat.completions.create(
                model="fake", messages=[{"role": "user", "content": "three nights"}], tools=[ROOMS])

    choice = run(go()).choices[0]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("book", {"nights": 3})]
    assert choice.finish_reason == "tool_calls"

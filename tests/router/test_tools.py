"""Tool calling's parts at the router (router/tools.py), no model running: bad tools and
tool choices are 400s naming the field and value; the prompt is the template's own
rendering where it knows tools, and a system message listing them where it does not; the
"required" structure takes a call to a listed tool and nothing else (xgrammar, as the
decode node compiles it); the calls of an "auto" answer are read in the dialect its
template asks for (Hermes, Llama 3 JSON, Mistral); and an answer's text gives the same
content and calls streamed in any pieces as whole."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.router.openai_protocol import OpenAIError, sampling_from_body, tools_of
from pdserve.router.tokenizer import PromptTokenizer
from pdserve.models_cli import TOOL_CALL_PARSERS
from pdserve.router.tool_dialects import DIALECTS, HERMES, dialect_of
from pdserve.router.tools import CallStream, merge_calls, tools_from_body
from tests.chat_checkpoint import write_tokenizer_only

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]
# A template that knows tools, as Qwen2.5's and Llama 3.1's do (much shortened).
TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>{% for t in tools %}{{ t | tojson }}{% endfor %}<|eos|>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]"
    "{% endfor %}<|eos|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
HISTORY = [{"role": "user", "content": "weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [{
               "id": "call_1", "type": "function",
               "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
           {"role": "tool", "tool_call_id": "call_2", "content": "12:00"}]


def tools(dialect=HERMES, **body):
    return tools_from_body({"tools": TOOLS, **body}, dialect)


@pytest.mark.parametrize("body,param,named", [
    ({"tools": "get_weather"}, "tools", "'get_weather'"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "'bad name'"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "tools[0]"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "given twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools", "'x'"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "'always'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope'"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "'yes'"),
])
def test_bad_tools_are_a_400_naming_the_field_and_value(body, param, named):
    with pytest.raises(OpenAIError) as err:
        tools_of(body)
    assert err.value.status == 400 and err.value.param == param and named in err.value.message


def test_a_forced_call_and_response_format_are_two_structures():
    body = {"model": "m", "tools": TOOLS, "tool_choice": "required",
            "response_format": {"type": "json_object"}}
    with pytest.raises(OpenAIError, match="send one") as err:
        sampling_from_body(body, chat=True, default_max_tokens=8, tools=tools_of(body))
    assert err.value.param == "tool_choice"
    auto = sampling_from_body({**body, "tool_choice": "auto"}, chat=True, default_max_tokens=8,
                              tools=tools(tool_choice="auto"))
    assert auto.structured_output.json_object  # "auto" asks for no structure of its own


def test_the_template_gets_the_tools_where_it_knows_them(tmp_path):
    from transformers import AutoTokenizer

    path = write_tokenizer_only(tmp_path, TOOLS_TEMPLATE)
    hf = AutoTokenizer.from_pretrained(str(path))
    with_objects = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": {"city": "Paris"}}}
                                         for c in m["tool_calls"]]} if "tool_calls" in m else m
                    for m in HISTORY]
    with_objects[1]["content"] = ""
    # a function without parameters reaches the template with an empty object's schema
    filled = [WEATHER, {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {}}}}]
    want = hf.apply_chat_template(with_objects, tools=filled, tokenize=False, add_generation_prompt=True)
    assert '[get_weather {"city": "Paris"}]' in want and '"get_time"' in want
    tokenizer = PromptTokenizer(str(path))
    assert tokenizer.chat_ids(HISTORY, tools()) == hf.encode(want, add_special_tokens=False)
    # "none": the tools stay out of the prompt, the conversation's calls do not
    none = hf.apply_chat_template(with_objects, tokenize=False, add_generation_prompt=True)
    assert tokenizer.chat_ids(HISTORY, tools(tool_choice="none")) == hf.encode(none, add_special_tokens=False)


def test_a_template_without_tools_gets_them_in_a_system_message(tiny_model):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_model)
    assert "tools" not in hf.chat_template
    text = hf.decode(PromptTokenizer(tiny_model).chat_ids(HISTORY, tools()))
    system, user, call, results = text.split("<|eos|>")[:4]
    assert system.startswith("<|system|>You may call functions")
    assert json.dumps(WEATHER) in system and json.dumps(TIME["function"]["name"]) in system
    assert user == "<|user|>weather in Paris?"
    assert call == '<|assistant|><tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert results == "<|user|><tool_response>\nsunny\n</tool_response>\n<tool_response>\n12:00\n</tool_response>"
    plain = PromptTokenizer(tiny_model).chat_ids([{"role": "system", "content": "be brief"}, HISTORY[0]], tools())
    assert hf.decode(plain).startswith("<|system|>be brief\n\nYou may call functions")


def test_a_call_with_arguments_that_are_not_text_is_refused(tiny_model):
    bad = [HISTORY[0], {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]
    with pytest.raises(ValueError, match=r"messages\[1\].tool_calls must be"):
        PromptTokenizer(tiny_model).chat_ids(bad, tools())


def test_required_holds_the_answer_to_calls_of_listed_tools(tiny_model):
    import xgrammar
    from transformers import AutoTokenizer

    from pdserve.engine.structured import Grammars
    from pdserve.sampling import StructuredOutput

    hf = AutoTokenizer.from_pretrained(tiny_model)
    grammars = Grammars(hf, 512, {hf.eos_token_id})

    def accepts(given, text: str) -> bool:
        spec = StructuredOutput("json_schema", given.structure().json_schema)
        return xgrammar.GrammarMatcher(grammars.compiled(spec)).accept_string(text)

    two = json.dumps([{"name": "get_weather", "arguments": {"city": "Paris"}},
                      {"name": "get_time", "arguments": {}}])  # xgrammar's spacing, as any_whitespace=False
    assert accepts(tools(tool_choice="required"), two)
    assert not accepts(tools(tool_choice="required", parallel_tool_calls=False), two)
    assert not accepts(tools(tool_choice="required"), '[{"name": "get_news", "arguments": {}}]')
    assert not accepts(tools(tool_choice="required"), "[]")
    named = tools(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert accepts(named, '{"city": "Paris"}') and not accepts(named, '{"town": "Paris"}')
    assert tools().structure() is None and tools(tool_choice="none").structure() is None


def answer(given, text: str, pieces: list[int], reason: str = "stop"):
    """(content, calls, finish reason) of `text` fed in `pieces` (cut points)."""
    stream, content, calls = CallStream(given), "", []
    for a, b in zip([0, *pieces], [*pieces, len(text)]):
        more, deltas = stream.feed(text[a:b])
        content += more
        merge_calls(calls, deltas)
    more, deltas, finish = stream.finish(reason)
    merge_calls(calls, deltas)
    return content + more, [(c["function"]["name"], c["function"]["arguments"]) for c in calls], finish


AUTO = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
       '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> done <tool_'


@pytest.mark.parametrize("text,content,calls,finish", [
    (AUTO, "Let me look.\ndone <tool_", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")], "tool_calls"),
    ("No call here, <tool but text.", "No call here, <tool but text.", [], "stop"),
    ('<tool_call>{"name": "get_news", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "get_news", "arguments": {}}</tool_call>', [], "stop"),
    ('<tool_call>{"name": "get_time", "arguments": {}}', "", [("get_time", "{}")], "tool_calls"),
])
def test_auto_gives_the_same_answer_streamed_in_any_pieces(text, content, calls, finish):
    for cut in range(len(text) + 1):
        assert answer(tools(), text, [cut]) == (content.strip() if calls else content, calls, finish), cut
    assert answer(tools(), text, list(range(1, len(text)))) == answer(tools(), text, [])


def test_required_named_and_none_answers():
    required = tools(tool_choice="required")
    text = '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    assert answer(required, text, [5, 40]) == ("", [("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')],
                                              "tool_calls")
    assert answer(required, text[:30], [], "length") == (text[:30], [], "length")  # cut short: text
    named = tools(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert answer(named, '{"city": "Oslo"}', [3, 9]) == ("", [("get_weather", '{"city": "Oslo"}')], "stop")
    assert answer(named, "", []) == ("", [("get_weather", "")], "stop")
    assert answer(tools(tool_choice="none"), AUTO, [7]) == (AUTO, [], "stop")
    serial = tools(parallel_tool_calls=False)
    assert answer(serial, AUTO, [])[1] == [("get_weather", '{"city": "Paris"}')]


# Each dialect's answers: (text, content, calls, finish reason), with a stop at the end.
LLAMA3, MISTRAL, PYTHONIC = DIALECTS["llama3_json"], DIALECTS["mistral"], DIALECTS["pythonic"]
DIALECT_ANSWERS = [
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
     [("get_weather", '{"city": "Paris"}')], "tool_calls"),
    (LLAMA3, ' <|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "arguments": '
             '{"city": "Oslo"}};', "", [("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')], "tool_calls"),
    (LLAMA3, '{"name": "get_time", "parameters": {}}\nIt is noon.', "It is noon.", [("get_time", "{}")],
     "tool_calls"),
    (LLAMA3, 'I will call {"name": "get_time", "parameters": {}}', None, [], "stop"),  # not first: text
    (LLAMA3, '{"answer": 4}', None, [], "stop"),
    (LLAMA3, '{"name": "get_time", "parameters": {}}; {"name": "get_news", "parameters": {}}', None, [], "stop"),
    (LLAMA3, '<|python_tag|', None, [], "stop"),
    (MISTRAL, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
              '{"name": "get_time", "arguments": {}}]', "",
     [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")], "tool_calls"),
    (MISTRAL, '[{"name": "get_time", "arguments": {}}]', "", [("get_time", "{}")], "tool_calls"),
    (MISTRAL, "[1] says it is sunny.", None, [], "stop"),
    (MISTRAL, '[TOOL_CALLS] {"name": "get_time", "arguments": {}}', None, [], "stop"),
    (MISTRAL, "Sunny, [TOOL_CALLS] later.", None, [], "stop"),
    (PYTHONIC, ' [get_weather(city="Paris", days=[1, 2]), get_time()]', "",
     [("get_weather", '{"city": "Paris", "days": [1, 2]}'), ("get_time", "{}")], "tool_calls"),
    (PYTHONIC, '[get_weather("Paris")]', None, [], "stop"),  # a positional argument names nothing
    (PYTHONIC, '[get_time(at=__import__("os"))]', None, [], "stop"),  # literals only: nothing runs
    (PYTHONIC, "[1] says it is sunny.", None, [], "stop"),
    (PYTHONIC, "Sunny [get_time()]", None, [], "stop"),
]


@pytest.mark.parametrize("dialect,text,content,calls,finish", DIALECT_ANSWERS)
def test_each_dialect_reads_its_calls_the_same_streamed_in_any_pieces(dialect, text, content, calls, finish):
    given = tools(dialect)
    want = (text if content is None else content, calls, finish)
    for cut in range(len(text) + 1):
        assert answer(given, text, [cut]) == want, cut
    assert answer(given, text, list(range(1, len(text)))) == want
    if calls and not content:  # a call cut short: the answer is its text
        assert answer(given, text[:-3], [], "length") == (text[:-3], [], "length")


def test_a_text_answer_streams_as_it_comes_in_every_dialect():
    for dialect in DIALECTS.values():
        stream = CallStream(tools(dialect))
        assert stream.feed("  ")[0] + stream.feed("It")[0] == "  It"  # out once it is not a call
        assert stream.feed(" is {") == (" is {", []) and stream.finish("stop") == ("", [], "stop")


def test_mistral_calls_get_the_nine_character_ids_its_template_takes():
    named = {"type": "function", "function": {"name": "get_time"}}
    for dialect, shape in ((MISTRAL, r"[A-Za-z0-9]{9}"), (LLAMA3, r"call_[0-9a-f]{24}"), (HERMES, r"call_[0-9a-f]{24}")):
        for given, text in ((tools(dialect, tool_choice=named), "{}"),
                            (tools(dialect, tool_choice="required"), '[{"name": "get_time", "arguments": {}}]')):
            stream = CallStream(given)
            deltas = stream.feed(text)[1] + stream.finish("stop")[1]
            assert re.fullmatch(shape, deltas[0]["id"]), (dialect.name, deltas)


# Excerpts of the real templates: the lines that say how the model is to call.
LLAMA31_TEMPLATE = (
    "{%- if tools is not none %}{{- 'Given the following functions, please respond with a JSON for a function "
    "call with its proper arguments that best answers the given prompt.\\n\\n' }}{{- 'Respond in the format "
    "{\"name\": function name, \"parameters\": dictionary of argument name and its value}.' }}{%- endif %}"
    "{%- if builtin_tools is defined %}{{- '<|python_tag|>' }}{%- endif %}")
MISTRAL_TEMPLATE = ('{%- if tools is not none %}{{- "[AVAILABLE_TOOLS] [" }}{%- endif %}'
                    '{%- for m in messages %}{%- if m.tool_calls is defined %}{{- "[TOOL_CALLS] [" }}{%- endif %}'
                    '{%- endfor %}')
LLAMA4_TEMPLATE = ("{%- if tools %}{{- 'If you decide to invoke any of the function(s), you MUST put it in the "
                   "format of [func_name1(params_name1=params_value1, params_name2=params_value2...), "
                   "func_name2(params)]' }}{%- endif %}")
QWEN_TEMPLATE = ("{%- if tools %}{{- '<tools>' }}{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}"
                 "{{- '</tools>\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
                 "\\n</tool_call>' }}{%- endif %}")


def test_the_template_names_the_dialect(tmp_path, tiny_model):
    templates = (LLAMA31_TEMPLATE, MISTRAL_TEMPLATE, LLAMA4_TEMPLATE, QWEN_TEMPLATE, TOOLS_TEMPLATE, None)
    assert [dialect_of(t).name for t in templates] == ["llama3_json", "mistral", "pythonic", "hermes", "hermes",
                                                        "hermes"]
    assert PromptTokenizer(tiny_model).tool_dialect is HERMES  # its system message asks for Hermes' blocks
    assert PromptTokenizer(str(write_tokenizer_only(tmp_path, MISTRAL_TEMPLATE))).tool_dialect is MISTRAL
    # --tool-call-parser names it instead; its choices are the dialects
    assert PromptTokenizer(tiny_model, tool_call_parser="llama3_json").tool_dialect is LLAMA3
    assert set(TOOL_CALL_PARSERS) == {"auto", *DIALECTS}


json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8)),
                           lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                   st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                           max_leaves=12)
tool_like = st.fixed_dictionaries({"type": st.sampled_from(["function", "other"])}, optional={
    "function": st.fixed_dictionaries({}, optional={
        "name": st.one_of(st.sampled_from(["get_weather", "get_time", "bad name"]), json_values),
        "description": json_values, "parameters": json_values})})


# Answers made of the pieces calls are written with, as well as of their characters.
PIECES = [" ", "\n", "text", "<tool_call>", "</tool_call>", "<tool_", "[TOOL_CALLS]", "<|python_tag|>", "<|py",
          '{"name": "get_time", "arguments": {}}', '{"name": "get_weather", "parameters": {"city": "x"}}',
          '{"name": "nope", "arguments": {}}', "get_time()", 'get_weather(city="x")', "[", "]", "{", "}", ";", ","]
answers = st.one_of(st.text(alphabet=st.sampled_from(list('<>/tool_cal{}":, ax[];|')), max_size=60),
                    st.lists(st.sampled_from(PIECES), max_size=8).map("".join))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(tools=st.one_of(json_values, st.lists(tool_like, max_size=3)),
       choice=st.one_of(json_values, st.sampled_from(["none", "auto", "required"]),
                        st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
                            {"name": st.sampled_from(["get_weather", "get_time", "nope"])})})),
       parallel=json_values, dialect=st.sampled_from(list(DIALECTS.values())), text=answers,
       cut=st.integers(0, 300))
def test_any_body_is_tools_or_a_400_and_any_answer_splits(tools, choice, parallel, dialect, text, cut):
    body = {"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel}
    try:
        given_tools = tools_of(body, dialect)
    except OpenAIError as err:
        assert err.status == 400 and err.param in ("tools", "tool_choice", "parallel_tool_calls")
        return
    if given_tools is not None:
        content, calls, finish = answer(given_tools, text, [min(cut, len(text))], "stop")
        assert all(name in given_tools.functions for name, _ in calls)
        assert (content, calls, finish) == answer(given_tools, text, [], "stop")

"""GPT-OSS's harmony answers (router/harmony.py): the analysis channel as reasoning, the
final one as content, a message to a function as its call; the same split streamed in any
pieces as whole; and through the router's OpenAI front over a node that streams the text
(a fake: the split is the router's), which is asked to keep the channels' markers."""

from __future__ import annotations

import pytest

from pdserve.router.harmony import HarmonyStream, speaks_harmony
from pdserve.router.tokenizer import PromptTokenizer
from pdserve.router.tool_dialects import HERMES, dialect_of
from tests.chat_checkpoint import write_tokenizer_only
from tests.router.fake_worker import FakeWorker, openai_router, run
from tests.router.test_reasoning import fed
from tests.router.test_tools import TOOLS

# gpt-oss's template, much shortened: its messages' shape, tools in the developer message.
HARMONY_TEMPLATE = (
    "{% if tools %}<|start|>developer<|message|># Tools{% for t in tools %}{{ t | tojson }}{% endfor %}<|end|>"
    "{% endif %}{% for m in messages %}{% if m.get('thinking') %}<|start|>assistant<|channel|>analysis<|message|>"
    "{{ m['thinking'] }}<|end|>{% endif %}<|start|>{{ m['role'] }}{% if m['role'] == 'assistant' %}"
    "<|channel|>final{% endif %}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")

THOUGHT = "<|channel|>analysis<|message|>User asks: \"capital?\" Simple.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>Paris is <b>the</b> capital.<|return|>"
CALL = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        "<|message|>{\"city\": \"Paris\"}<|call|>")
BLOCK = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def split(text: str, cuts: list[int]) -> tuple[str, str]:
    return fed(HarmonyStream(), text, cuts)


@pytest.mark.parametrize("text,want", [
    (THOUGHT + FINAL, ("User asks: \"capital?\" Simple.", "Paris is <b>the</b> capital.")),
    (THOUGHT + FINAL.removesuffix("<|return|>"), ("User asks: \"capital?\" Simple.", "Paris is <b>the</b> capital.")),
    (THOUGHT + CALL, ("User asks: \"capital?\" Simple.", BLOCK)),
    # the recipient in the role's part of the header, the call cut short of <|call|>
    ("<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Paris\"}",
     ("", BLOCK)),
    ("<|channel|>commentary<|message|>Checking two things.<|end|>" + CALL, ("", "Checking two things." + BLOCK)),
    ("<|channel|>analysis to=browser.search<|message|>{\"query\": \"x\"}<|call|>", ("{\"query\": \"x\"}", "")),
    ("<|channel|>final<|message|>not JSON: <|call|>", ("", "not JSON: ")),
    ("<|channel|>commentary to=functions.f<|message|>{oops<|call|>", ("", "<tool_call>{oops</tool_call>")),
    ("analysisUser asks.assistantfinalParis.", ("", "analysisUser asks.assistantfinalParis.")),  # markers dropped
    ("<|channel|>final<|message|>cut at <|en", ("", "cut at <|en")),
    (THOUGHT + "<|start|>assistant<|chan", ("User asks: \"capital?\" Simple.", "")),  # a header never finished
    ("  ", ("", "  ")),
    ("", ("", "")),
])
def test_streamed_in_any_pieces_the_split_is_the_whole_one(text, want):
    for cut in range(len(text) + 1):
        assert split(text, [cut]) == want, cut
    assert split(text, list(range(1, len(text)))) == want


def test_a_template_with_channels_speaks_harmony_and_its_calls_are_read_as_hermes(tmp_path):
    assert speaks_harmony(HARMONY_TEMPLATE) and not speaks_harmony(None) and not speaks_harmony("<|message|>")
    assert dialect_of(HARMONY_TEMPLATE) is HERMES
    tokenizer = PromptTokenizer(str(write_tokenizer_only(tmp_path, HARMONY_TEMPLATE)))
    assert tokenizer.harmony and not tokenizer.thinks


def test_a_harmony_answer_ends_at_return_or_call_not_at_the_end_of_a_message(tmp_path):
    from transformers import PreTrainedTokenizerFast

    out = write_tokenizer_only(tmp_path, HARMONY_TEMPLATE)
    tok = PreTrainedTokenizerFast.from_pretrained(str(out))
    tok.add_special_tokens({"additional_special_tokens": ["<|start|>", "<|channel|>", "<|message|>", "<|end|>",
                                                          "<|return|>", "<|call|>"]})
    tok.save_pretrained(str(out))
    ends = PromptTokenizer(str(out)).end_of_turn_ids
    vocab = tok.get_vocab()
    # An assistant message closes with <|end|> in the template, but an answer goes on past it.
    assert vocab["<|end|>"] not in ends and {vocab["<|return|>"], vocab["<|call|>"], 2} <= set(ends)


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_an_earlier_answers_reasoning_goes_back_to_the_template_as_its_thinking(tmp_path, field):
    tokenizer = PromptTokenizer(str(write_tokenizer_only(tmp_path, HARMONY_TEMPLATE)))
    messages = [{"role": "user", "content": "capital?"}, {"role": "assistant", "content": "Paris.", field: "Easy."},
                {"role": "user", "content": "and of Italy?"}]
    text = tokenizer.tokenizer.decode(tokenizer.chat_ids(messages))
    assert "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Paris." in text
    with pytest.raises(ValueError, match=r"messages\[1\]\.reasoning_content must be a string.*\['Easy'\]"):
        tokenizer.chat_ids([*messages[:1], {**messages[1], field: ["Easy"]}])


PIECES = ["<|channel|>", "analysis", "<|message|>", "Need the", " weather.", "<|end|>", "<|start|>", "assistant",
          "<|channel|>", "commentary to=functions.get_weather <|constrain|>json", "<|message|>", '{"city": ',
          '"Paris"}', "<|call|>"]


@pytest.mark.parametrize("stream", [False, True])
def test_an_openai_client_gets_reasoning_and_the_call_and_the_node_keeps_the_markers(tmp_path, stream):
    import openai

    worker = FakeWorker("d", texts=PIECES, finish="stop")  # <|call|> is an eos

    async def go():
        tokenizer = PromptTokenizer(str(write_tokenizer_only(tmp_path, HARMONY_TEMPLATE)), "fake")
        async with openai_router([worker], tokenizer) as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            reply = await client.chat.completions.create(
                model="fake", messages=[{"role": "user", "content": "weather in Paris?"}], tools=TOOLS,
                stream=stream, max_tokens=len(PIECES) + 1)
            return [chunk async for chunk in reply] if stream else reply

    reply = run(go())
    if stream:
        deltas = [c.choices[0].delta for c in reply if c.choices]
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
        calls = [c for d in deltas for c in d.tool_calls or ()]
        finish = reply[-1].choices[0].finish_reason
    else:
        message = reply.choices[0].message
        reasoning, content = getattr(message, "reasoning_content", None), message.content or ""
        calls, finish = message.tool_calls, reply.choices[0].finish_reason
    assert reasoning == "Need the weather."
    assert content == "" and not any("<|" in str(c) for c in calls)
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]
    assert finish == "tool_calls"
    sampling = next(request.sampling for name, request in worker.calls if name == "PrepareReceive")
    assert sampling.HasField("skip_special_tokens") and not sampling.skip_special_tokens

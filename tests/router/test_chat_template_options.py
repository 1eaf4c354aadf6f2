"""vLLM's chat-template extras at the router (router/chat.py `template_options`): the prompt
is what transformers' `apply_chat_template` renders with the same arguments, and a bad
value is a 400 naming its field."""

from __future__ import annotations

import pytest

from pdserve.router.openai_protocol import OpenAIError, chat_prompt
from pdserve.router.tokenizer import PromptTokenizer
from tests.chat_checkpoint import write_tokenizer_only

# Qwen3's switch, much shortened: a thinking block opened unless enable_thinking is false.
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eos|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>"
            "{% if enable_thinking is defined and not enable_thinking %}[no thinking]{% endif %}{% endif %}")
ASKED = [{"role": "user", "content": "name a fox"}]
STARTED = [*ASKED, {"role": "assistant", "content": "the quick"}]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from transformers import AutoTokenizer

    path = write_tokenizer_only(tmp_path_factory.mktemp("options"), TEMPLATE)
    return PromptTokenizer(str(path)), AutoTokenizer.from_pretrained(str(path))


@pytest.mark.parametrize("extra,messages,hf_args", [
    ({}, ASKED, dict(add_generation_prompt=True)),
    ({"chat_template_kwargs": {"enable_thinking": False}}, ASKED, dict(add_generation_prompt=True,
                                                                       enable_thinking=False)),
    ({"add_generation_prompt": False}, ASKED, dict(add_generation_prompt=False)),
    ({"continue_final_message": True}, STARTED, dict(continue_final_message=True)),
    ({"continue_final_message": True, "add_generation_prompt": False}, STARTED, dict(continue_final_message=True)),
])
def test_the_prompt_is_the_template_rendered_with_the_same_arguments(tokenizers, extra, messages, hf_args):
    ours, hf = tokenizers
    want = hf.apply_chat_template(messages, tokenize=False, **hf_args)
    got = chat_prompt({"messages": messages, **extra}, ours)
    assert got == hf.encode(want, add_special_tokens=False)
    if extra.get("continue_final_message"):
        assert want.endswith("the quick")  # the answer goes on, its turn left open
    if extra.get("chat_template_kwargs"):
        assert want.endswith("[no thinking]")


# gpt-oss's levels, much shortened: the template writes the effort it is given.
LEVELS = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eos|>{% endfor %}"
          "<|system|>Reasoning: {{ reasoning_effort | default('medium') }}<|assistant|>")


@pytest.fixture(scope="module")
def leveled(tmp_path_factory):
    return PromptTokenizer(str(write_tokenizer_only(tmp_path_factory.mktemp("levels"), LEVELS)))


@pytest.mark.parametrize("effort,ends", [("none", "[no thinking]"), ("high", "<|assistant|>")])
def test_reasoning_effort_turns_a_switch_template_off_or_on(tokenizers, effort, ends):
    ours, hf = tokenizers
    want = hf.apply_chat_template(ASKED, tokenize=False, add_generation_prompt=True,
                                  enable_thinking=effort != "none")
    assert want.endswith(ends)
    assert chat_prompt({"messages": ASKED, "reasoning_effort": effort}, ours) == hf.encode(
        want, add_special_tokens=False)


def test_reasoning_effort_reaches_a_template_with_levels(leveled):
    text = leveled.tokenizer.decode(chat_prompt({"messages": ASKED, "reasoning_effort": "low"}, leveled))
    assert text.endswith("Reasoning: low<|assistant|>")
    plain = leveled.tokenizer.decode(chat_prompt({"messages": ASKED}, leveled))
    assert plain.endswith("Reasoning: medium<|assistant|>")


# Command R's retrieval shape, much shortened: the documents before the turns.
RETRIEVAL = ("{% if documents %}<|system|>{% for d in documents %}[{{ d['title'] }}: {{ d['text'] }}]{% endfor %}"
             "<|eos|>{% endif %}" + LEVELS)


def test_documents_reach_a_retrieval_template_as_transformers_renders_them(tmp_path):
    from transformers import AutoTokenizer

    path = write_tokenizer_only(tmp_path, RETRIEVAL)
    documents = [{"title": "foxes", "text": "they are quick"}, {"title": "dogs", "text": "lazy"}]
    want = AutoTokenizer.from_pretrained(str(path)).apply_chat_template(
        ASKED, tokenize=False, add_generation_prompt=True, documents=documents)
    assert "[foxes: they are quick][dogs: lazy]" in want
    ours = PromptTokenizer(str(path))
    assert ours.tokenizer.decode(chat_prompt({"messages": ASKED, "documents": documents}, ours)) == want
    for bad in ([{"title": 1}], "doc"):
        with pytest.raises(OpenAIError, match="documents must be a list of objects of strings") as err:
            chat_prompt({"messages": ASKED, "documents": bad}, ours)
        assert err.value.param == "documents"


def test_reasoning_effort_is_refused_by_a_template_without_reasoning(tmp_path):
    plain = PromptTokenizer(str(write_tokenizer_only(tmp_path, TEMPLATE.replace("enable_thinking", "other"))))
    with pytest.raises(OpenAIError) as err:
        chat_prompt({"messages": ASKED, "reasoning_effort": "low"}, plain)
    assert err.value.param == "reasoning_effort" and "takes no reasoning effort" in err.value.message
    with pytest.raises(OpenAIError) as err:  # nor documents, which it would leave out
        chat_prompt({"messages": ASKED, "documents": [{"text": "x"}]}, plain)
    assert err.value.param == "documents" and "put them in a message instead" in err.value.message


@pytest.mark.parametrize("extra,messages,param,says", [
    ({"reasoning_effort": "max"}, ASKED, "reasoning_effort", "one of none, minimal, low, medium, high, xhigh, "
                                                             "got 'max'"),
    ({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}, ASKED, "reasoning_effort",
     "chat_template_kwargs.enable_thinking True disagree"),
    ({"add_generation_prompt": "yes"}, ASKED, "add_generation_prompt", "must be a boolean, got 'yes'"),
    ({"continue_final_message": True, "add_generation_prompt": True}, STARTED, "continue_final_message",
     "send add_generation_prompt: false"),
    ({"continue_final_message": True}, ASKED, "messages", "the assistant's, got role 'user'"),
    ({"chat_template_kwargs": ["enable_thinking"]}, ASKED, "chat_template_kwargs", "an object of template"),
    ({"chat_template_kwargs": {"tools": []}}, ASKED, "chat_template_kwargs", "may not set 'tools'"),
])
def test_a_bad_option_is_a_400_naming_it(tokenizers, extra, messages, param, says):
    with pytest.raises(OpenAIError) as err:
        chat_prompt({"messages": messages, **extra}, tokenizers[0])
    assert err.value.status == 400 and err.value.param == param and says in err.value.message

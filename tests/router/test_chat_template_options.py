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


@pytest.mark.parametrize("extra,messages,param,says", [
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

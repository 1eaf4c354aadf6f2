"""`--chat-template FILE|TEMPLATE` (router, serve, up): a file's text or the template itself
(escapes decoded, as vLLM takes it), rendering conversations instead of the checkpoint's own
template; a value that is neither, or a template that does not parse, stops the server
before it starts, naming the flag and the line."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser, cmd_router
from pdserve.models_cli import chat_template_of
from pdserve.router.tokenizer import PromptTokenizer
from tests.chat_checkpoint import write_tokenizer_only

BRACKETS = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "


def test_a_file_or_the_template_itself_is_the_template(tmp_path):
    path = tmp_path / "brackets.jinja"
    path.write_text(BRACKETS)
    assert chat_template_of(str(path)) == BRACKETS
    assert chat_template_of(BRACKETS.replace("\n", "\\n")) == BRACKETS  # one line, as vLLM takes it
    assert chat_template_of("{{ 'é → ' }}\\n") == "{{ 'é → ' }}\n"  # other characters as given
    assert chat_template_of(None) is None


@pytest.mark.parametrize("value,named", [
    ("/no/such/template.jinja", "is no file, nor a Jinja template"),
    ("{% for m in messages %}{{ m }}", "does not parse: line 1"),
])
def test_neither_a_file_nor_a_template_stops_the_server_naming_the_flag(value, named, tmp_path):
    with pytest.raises(ValueError, match=named):
        chat_template_of(value)
    model = str(write_tokenizer_only(tmp_path, None))
    args = build_parser().parse_args(["router", "--model", model, "--decode", "127.0.0.1:1",
                                      "--port", "0", "--chat-template", value])
    with pytest.raises(SystemExit, match=f"pdserve router: --chat-template .*{named}"):
        cmd_router(args)


def test_the_template_renders_conversations_and_gives_the_end_of_turn(tmp_path):
    from transformers import AutoTokenizer

    model = str(write_tokenizer_only(tmp_path, None))  # no template of its own
    with pytest.raises(ValueError, match="--chat-template"):
        PromptTokenizer(model).chat_ids([{"role": "user", "content": "hi"}])
    template = BRACKETS.replace("\n{% endfor %}", "<|eos|>{% endfor %}")
    tokenizer = PromptTokenizer(model, chat_template=template)
    hf = AutoTokenizer.from_pretrained(model)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    want = hf.apply_chat_template(messages, chat_template=template, tokenize=False)
    assert want == "[system] be brief<|eos|>[user] hi<|eos|>[assistant] "
    assert tokenizer.chat_ids(messages) == hf.encode(want, add_special_tokens=False)
    assert tokenizer.end_of_turn_ids == [2]  # the template's closer, <|eos|>

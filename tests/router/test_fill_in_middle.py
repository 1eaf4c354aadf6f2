"""A completions `suffix` (router/fill_in_middle.py): the prompt served is prefix, suffix and
the model's fill-in-the-middle tokens in prefix-suffix-middle order, ids built as the
model's own tokenizer builds them; a model without those tokens refuses a suffix."""

from __future__ import annotations

import json

import pytest

from pdserve.router.fill_in_middle import FIM_TOKENS, with_suffix
from pdserve.router.openai_protocol import OpenAIError
from pdserve.router.tokenizer import PromptTokenizer
from tests.chat_checkpoint import write_tokenizer_only
from tests.router.fake_worker import FakeWorker, openai_router, run

QWEN = FIM_TOKENS[0]


def coder(path, tokens=QWEN) -> PromptTokenizer:
    """The tiny tokenizer with a code model's three fill-in-the-middle tokens added."""
    from transformers import PreTrainedTokenizerFast

    write_tokenizer_only(path, None)
    tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    tok.add_special_tokens({"additional_special_tokens": list(tokens)})
    tok.save_pretrained(str(path))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "vocab_size": len(tok)}))  # the new ids too
    return PromptTokenizer(str(path), "fake")


@pytest.mark.parametrize("tokens", FIM_TOKENS[:2], ids=["qwen", "starcoder"])
def test_the_prompt_is_prefix_suffix_middle_in_the_models_tokens(tmp_path, tokens):
    tokenizer = coder(tmp_path, tokens)
    hf = tokenizer.tokenizer
    pre, suf, mid = hf.convert_tokens_to_ids(list(tokens))
    assert max(pre, suf, mid) < tokenizer.card.vocab_size
    prompts = [tokenizer.encode("def add(a, b):\n"), [5, 6]]
    served = with_suffix({"suffix": "\n    return total\n"}, prompts, tokenizer, "fake")
    assert served == [[pre, *p, suf, *hf.encode("\n    return total\n", add_special_tokens=False), mid]
                      for p in prompts]
    # what transformers renders from the same text, token for token
    text = f"{tokens[0]}def add(a, b):\n{tokens[1]}\n    return total\n{tokens[2]}"
    assert served[0] == hf.encode(text, add_special_tokens=False)
    assert with_suffix({"suffix": ""}, prompts, tokenizer, "fake") == prompts


@pytest.mark.parametrize("body,says", [
    ({"suffix": 5}, "suffix must be a string, got 5"),
    ({"suffix": "x", "echo": True}, "echo cannot be sent with suffix"),
])
def test_a_bad_suffix_is_a_400_naming_it(tmp_path, body, says):
    with pytest.raises(OpenAIError) as err:
        with_suffix(body, [[5]], coder(tmp_path), "fake")
    assert (err.value.status, err.value.param) == (400, "suffix") and says in err.value.message


def test_a_served_suffix_reaches_the_node_and_a_model_without_the_tokens_refuses_it(tmp_path):
    import aiohttp

    async def post(tokenizer, worker, body):
        async with openai_router([worker], tokenizer) as url, aiohttp.ClientSession() as session:
            async with session.post(f"{url}/v1/completions", json={
                    "model": "fake", "prompt": "def f():", "max_tokens": 2, **body}) as reply:
                return reply.status, await reply.json()

    tokenizer, worker = coder(tmp_path / "coder"), FakeWorker("d")
    status, _ = run(post(tokenizer, worker, {"suffix": " return 1"}))
    [sent] = [msg for rpc, msg in worker.calls if rpc == "StartGeneration"]
    assert status == 200 and list(sent.prepare.prompt_token_ids) == with_suffix(
        {"suffix": " return 1"}, [tokenizer.encode("def f():")], tokenizer, "fake")[0]

    plain = PromptTokenizer(str(write_tokenizer_only(tmp_path / "plain", None)), "fake")
    status, reply = run(post(plain, FakeWorker("d"), {"suffix": " return 1"}))
    assert status == 400 and reply["error"]["param"] == "suffix"
    assert "fake's tokenizer has no fill-in-the-middle tokens" in json.dumps(reply)

"""A Responses conversation fitted to the context (router/response_history.py `fitted`):
with `truncation: "auto"` the oldest whole turns are left out, never the instructions nor
the last turn; without it the same request is refused by the context check."""

from __future__ import annotations

import json

import pytest

from pdserve.engine.checkpoint import CHAT_TEMPLATE
from pdserve.router import validation
from pdserve.router.openai_protocol import chat_prompt
from pdserve.router.response_history import fitted
from pdserve.router.tokenizer import PromptTokenizer
from tests.chat_checkpoint import write_tokenizer_only


def turns(n: int) -> list[dict]:
    out = [{"role": "system", "content": "be brief"}]
    for i in range(n):
        out += [{"role": "user", "content": f"question {i} " + "the quick brown fox " * 20},
                {"role": "assistant", "content": f"answer {i} " + "jumps over the lazy dog " * 20}]
    return [*out, {"role": "user", "content": "the last question"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return PromptTokenizer(str(write_tokenizer_only(tmp_path_factory.mktemp("history"), CHAT_TEMPLATE)), "fake")


def test_the_oldest_turns_go_until_the_prompt_and_the_output_fit(tokenizer):
    card = tokenizer.card
    body = {"messages": turns(12), "max_completion_tokens": 40}
    render = lambda b: chat_prompt(b, tokenizer)  # noqa: E731
    whole = render(body)
    assert len(whole) + 40 > card.max_model_len  # it would not fit whole
    ids = fitted(body, render, card.max_model_len, validation.max_prompt_chars(card))
    assert len(ids) + 40 <= card.max_model_len
    text = tokenizer.decode(ids)
    assert "be brief" in text and text.count("the last question") == 1 and "question 0 " not in text
    kept = [i for i in range(12) if f"question {i} " in text]
    assert kept and kept == list(range(kept[0], 12))  # the newest turns, whole: each with its answer
    assert all(f"answer {i} " in text for i in kept)
    assert fitted({"messages": turns(1)}, render, card.max_model_len, 10**6) == render({"messages": turns(1)})


def test_over_http_auto_fits_and_disabled_is_a_400_naming_the_context(tmp_path, tokenizer):
    import aiohttp

    from tests.router.fake_worker import FakeWorker, openai_router, run

    items = [{"role": m["role"], "content": m["content"]} for m in turns(12)[1:]]

    async def go():
        replies = []
        async with openai_router([FakeWorker("d")], tokenizer) as url, aiohttp.ClientSession() as session:
            for truncation in ("auto", "disabled"):
                async with session.post(url + "/v1/responses", json={
                        "model": "fake", "input": items, "instructions": "be brief", "max_output_tokens": 40,
                        "truncation": truncation}) as reply:
                    replies.append((reply.status, json.loads(await reply.text())))
        return replies

    (auto, answer), (disabled, error) = run(go())
    assert auto == 200 and answer["status"] in ("completed", "incomplete")
    assert disabled == 400 and "maximum context length" in error["error"]["message"]

"""A thinking model's reasoning apart from its answer (router/reasoning.py): the same split
streamed in any pieces as whole, and through the router's OpenAI front over a decode node
that streams the text (a fake: the split is the router's, not the model's)."""

from __future__ import annotations

import json

import aiohttp
import pytest

from pdserve.router.reasoning import ReasoningStream, thinks
from pdserve.router.tokenizer import PromptTokenizer
from tests.chat_checkpoint import write_tokenizer_only
from tests.router.fake_worker import FakeWorker, openai_router, run

THINKING_TEMPLATE = (  # Qwen3's shape, much shortened: past answers lose their reasoning
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'].split('</think>')[-1] }}<|eos|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if opened %}<think>\n{% endif %}{% endif %}")


def split(text: str, cuts: list[int], started: bool = False) -> tuple[str, str]:
    return fed(ReasoningStream(started), text, cuts)


def fed(stream, text: str, cuts: list[int]) -> tuple[str, str]:
    """(reasoning, content) of `text` fed to `stream` (a ReasoningStream or a HarmonyStream)
    in the pieces `cuts` makes, then finished."""
    reasoning, content = "", ""
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        r, c = stream.feed(text[a:b])
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("text,started,want", [
    ("<think>\nthe user wants a city\n</think>\n\nParis.", False, ("\nthe user wants a city\n", "Paris.")),
    ("Paris, <think> is text here.", False, ("", "Paris, <think> is text here.")),
    ("  \n<think>short</think>Paris", False, ("short", "Paris")),
    ("<think>cut short in its reasoning </thi", False, ("cut short in its reasoning </thi", "")),
    ("the prompt opened it</think> Paris", True, ("the prompt opened it", "Paris")),
    ("<thin", False, ("", "<thin")),
    ("", False, ("", "")),
])
def test_streamed_in_any_pieces_the_split_is_the_whole_one(text, started, want):
    for cut in range(len(text) + 1):
        assert split(text, [cut], started) == want, cut
    assert split(text, list(range(1, len(text))), started) == want


def test_a_model_thinks_when_its_template_knows_the_closing_tag(tmp_path, tiny_model):
    assert thinks(THINKING_TEMPLATE) and not thinks(None)
    assert not PromptTokenizer(tiny_model).thinks
    tokenizer = PromptTokenizer(str(write_tokenizer_only(tmp_path, THINKING_TEMPLATE)))
    messages = [{"role": "user", "content": "capital of France?"}]
    assert tokenizer.thinks and not tokenizer.opens_thinking(tokenizer.chat_ids(messages))
    opened = tokenizer.chat_ids(messages, options={"add_generation_prompt": True, "opened": True})
    assert tokenizer.opens_thinking(opened)


PIECES = ["<thi", "nk>\nthe user", " wants a city</th", "ink>\n\n", "Par", "is."]


@pytest.mark.parametrize("stream", [False, True])
def test_the_openai_front_answers_reasoning_and_content_apart(tmp_path, stream):
    """With vLLM's return_token_ids: every token's id, held-back text (a tag) or not, and the
    prompt's ids once."""
    tokenizer = PromptTokenizer(str(write_tokenizer_only(tmp_path, THINKING_TEMPLATE)))

    async def go():
        async with openai_router([FakeWorker("d", texts=PIECES)], tokenizer) as url:
            async with aiohttp.ClientSession() as session:
                async with session.post(f"{url}/v1/chat/completions", json={
                        "model": "fake", "messages": [{"role": "user", "content": "capital?"}],
                        "max_tokens": 8, "stream": stream, "return_token_ids": True}) as reply:
                    assert reply.status == 200
                    if not stream:
                        return await reply.json()
                    return [json.loads(line[6:]) for line in (await reply.text()).splitlines()
                            if line.startswith("data: {")]

    answer = run(go())
    prompt = tokenizer.chat_ids([{"role": "user", "content": "capital?"}])
    if stream:
        assert answer[0]["prompt_token_ids"] == prompt and all("prompt_token_ids" not in c for c in answer[1:])
        assert [t for c in answer for t in c["choices"][0].get("token_ids", [])] == list(range(10, 16))
        deltas = [c["choices"][0]["delta"] for c in answer]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "\nthe user wants a city"
        assert "".join(d.get("content") or "" for d in deltas) == "Paris."
        assert not any("<" in (d.get("content") or "") + d.get("reasoning_content", "") for d in deltas)
        assert answer[-1]["choices"][0]["finish_reason"] == "length"
    else:
        assert answer["prompt_token_ids"] == prompt and answer["choices"][0]["token_ids"] == list(range(10, 16))
        message = answer["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("\nthe user wants a city", "Paris.")

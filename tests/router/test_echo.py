"""OpenAI's completions `echo` at the router's front (router/echo.py), over a fake decode
node in-process: each choice starts with its prompt as sent, the prompt's logprobs (from
the node) come first with a null for the first token, `max_tokens: 0` gives the prompt
alone, streamed or not (each token's `text_offset` counted across chunks), and values echo
cannot take are 400s naming the field."""

from __future__ import annotations

import json

import aiohttp
import pytest

from pdserve.proto import pdserve_pb2
from pdserve.router.echo import Echo
from tests.router.fake_worker import FakeWorker, openai_router, run


class Scores(FakeWorker):
    """Answers each choice with tokens "x", "y" (each at logprob -0.5, when asked); with
    prompt_logprobs asked, scores prompt token k at -k on each choice's first message, as a
    decode node does."""

    async def StartGeneration(self, request, context):
        prepare = request.prepare
        self.calls.append(("StartGeneration", prepare))
        ids, sampling = list(prepare.prompt_token_ids), prepare.sampling
        scored = [pdserve_pb2.TokenLogprob(token_id=t, logprob=-k, top=[
            pdserve_pb2.TopLogprob(token_id=t, logprob=-k)]) for k, t in enumerate(ids[1:], 1)] \
            if sampling.HasField("prompt_logprobs") else []
        tokens = [ord("x"), ord("y")][:sampling.max_tokens]
        for j in range(sampling.n or 1):
            for i, t in enumerate(tokens):
                yield pdserve_pb2.GenerateResponse(
                    request_id=request.request_id, index=j, text=chr(t), token_ids=[t],
                    finish_reason="length" if i == len(tokens) - 1 else "",
                    logprobs=[pdserve_pb2.TokenLogprob(token_id=t, logprob=-0.5)]
                    if sampling.HasField("logprobs") else [],
                    prompt_logprobs=scored if i == 0 else [])
        yield pdserve_pb2.GenerateResponse(request_id=request.request_id, usage=pdserve_pb2.Usage(
            prompt_tokens=len(ids), completion_tokens=len(tokens) * (sampling.n or 1),
            total_tokens=len(ids) + len(tokens) * (sampling.n or 1)))


async def _post(worker, body: dict) -> tuple[int, str]:
    async with openai_router([worker]) as url, aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json={"model": "fake", **body}) as reply:
            return reply.status, await reply.text()


def test_max_tokens_0_gives_each_prompt_scored_and_nothing_else():
    worker = Scores("d")
    status, text = run(_post(worker, {"prompt": ["abc", [104, 105]], "echo": True, "logprobs": 1,
                                      "max_tokens": 0, "n": 2}))
    assert status == 200, text
    reply = json.loads(text)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in reply["choices"]] == [
        (0, "abc", "length"), (1, "abc", "length"), (2, "hi", "length"), (3, "hi", "length")]
    assert reply["choices"][0]["logprobs"] == {
        "tokens": ["a", "b", "c"], "token_logprobs": [None, -1.0, -2.0],
        "top_logprobs": [None, {"b": -1.0}, {"c": -2.0}], "text_offset": [0, 1, 2]}
    assert reply["choices"][3]["logprobs"]["token_logprobs"] == [None, -1.0]
    assert (reply["usage"]["prompt_tokens"], reply["usage"]["completion_tokens"],
            reply["usage"]["total_tokens"]) == (5, 0, 5)
    sent = [c.sampling for name, c in worker.calls if name == "StartGeneration"]
    assert [(s.max_tokens, s.prompt_logprobs, s.logprobs) for s in sent] == [(1, 1, 1)] * 2


def test_a_scored_prompt_returns_its_ids_and_no_token_ids():
    status, text = run(_post(Scores("d"), {"prompt": "abc", "echo": True, "logprobs": 1, "max_tokens": 0,
                                           "return_token_ids": True}))
    choice = json.loads(text)["choices"][0]
    assert status == 200 and (choice["prompt_token_ids"], choice["token_ids"]) == ([97, 98, 99], [])


def test_return_tokens_as_token_ids_labels_each_token_by_its_id_and_keeps_the_texts_offsets():
    status, text = run(_post(Scores("d"), {"prompt": "abc", "echo": True, "logprobs": 1, "max_tokens": 0,
                                           "return_tokens_as_token_ids": True}))
    assert status == 200, text
    assert json.loads(text)["choices"][0]["logprobs"] == {
        "tokens": ["token_id:97", "token_id:98", "token_id:99"], "token_logprobs": [None, -1.0, -2.0],
        "top_logprobs": [None, {"token_id:98": -1.0}, {"token_id:99": -2.0}], "text_offset": [0, 1, 2]}
    status, text = run(_post(Scores("d"), {"prompt": "abc", "return_tokens_as_token_ids": "yes"}))
    assert status == 400 and json.loads(text)["error"]["param"] == "return_tokens_as_token_ids"


@pytest.mark.parametrize("node_says,answer_says", [("stop", "length"), ("length", "length"),
                                                   ("abort", "abort"), ("", "")])
def test_the_prompt_alone_ends_as_length_unless_aborted(node_says, answer_says):
    echo = Echo(["ab"], [97], 1, logprobs=False, generate=False)
    msg = pdserve_pb2.GenerateResponse(index=0, text="x", token_ids=[120], finish_reason=node_says)
    assert echo.choice(msg) == ("ab", [], answer_says)


def test_a_streamed_echo_starts_each_choice_with_its_prompt():
    status, text = run(_post(Scores("d"), {"prompt": "ab", "echo": True, "logprobs": 0, "n": 2,
                                           "max_tokens": 2, "stream": True}))
    assert status == 200, text
    chunks = [json.loads(line[6:]) for line in text.splitlines()
              if line.startswith("data: {")]
    by_choice: dict[int, list] = {}
    for c in chunks:
        by_choice.setdefault(c["choices"][0]["index"], []).append(c["choices"][0])
    for parts in by_choice.values():
        assert [p["text"] for p in parts] == ["abx", "y"]
        assert [p["logprobs"]["token_logprobs"] for p in parts] == [[None, -1.0, -0.5], [-0.5]]
        # where each token's text starts in the choice's text, counted across the chunks
        assert [p["logprobs"]["text_offset"] for p in parts] == [[0, 1, 2], [3]]
    assert sorted(by_choice) == [0, 1]


def test_echo_without_logprobs_asks_the_node_for_no_prompt_scoring():
    worker = Scores("d")
    status, text = run(_post(worker, {"prompt": "ab", "echo": True, "max_tokens": 2}))
    assert status == 200, text
    choice = json.loads(text)["choices"][0]
    assert choice["text"] == "abxy" and choice["logprobs"] is None
    [sent] = [c.sampling for name, c in worker.calls if name == "StartGeneration"]
    assert not sent.HasField("prompt_logprobs")


@pytest.mark.parametrize("body,param,message", [
    ({"prompt": "ab", "echo": "yes"}, "echo", "echo must be a boolean"),
    ({"prompt": "ab", "max_tokens": 0}, "max_tokens",
     "max_tokens must be at least 1 (0, the prompt alone, needs echo: true), got 0"),
    ({"prompt": "ab", "echo": True, "logprobs": 21}, "logprobs",
     "logprobs must be None or an integer in [0, 20], got 21"),
])
def test_what_echo_cannot_take_is_a_400_naming_the_field(body, param, message):
    worker = Scores("d")
    status, text = run(_post(worker, body))
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] == param and message in error["message"], text
    assert worker.calls == []

"""A /v1/completions request with several prompts (router/prompt_batch.py), over fake
workers in-process: each prompt is a request of its own, its choices come back in OpenAI's
order (prompt i's choice j at i * n + j), usage comes once for the batch, a bad prompt is a
400 naming it before any node works, and a prompt the nodes refuse fails the batch and
aborts the prompts already running."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import grpc
import pytest

from pdserve.proto import pdserve_pb2
from pdserve.router.openai_protocol import OpenAIError, completion_prompts
from tests.router.fake_worker import CharTokenizer, FakeWorker, openai_router, reached, run


class EchoesPrompt(FakeWorker):
    """Answers choice j of a prompt with the prompt's first character and j. A prompt that
    starts with "!" finds the node full (`late`: once another prompt was answered); with
    `gate` given, the others wait for it."""

    def __init__(self, name: str, gate: asyncio.Event | None = None, late: bool = False) -> None:
        super().__init__(name)
        self.prepared: dict[str, pdserve_pb2.PrepareReceiveRequest] = {}
        self.gate, self.late = gate, late
        self.answered = asyncio.Event()

    async def PrepareReceive(self, request, context):
        self.calls.append(("PrepareReceive", request))
        if request.prompt_token_ids[0] == ord("!"):
            if self.late:
                await self.answered.wait()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free KV pages")
        self.prepared[request.request_id] = request
        return await super().PrepareReceive(request, context)

    async def StartGeneration(self, request, context):
        if request.HasField("prepare"):
            prepare = request.prepare
            await self.PrepareReceive(prepare, context)
        else:
            prepare = self.prepared[request.request_id]
        self.calls.append(("StartGeneration", request))
        if self.gate is not None:
            await self.gate.wait()
        first, n = chr(prepare.prompt_token_ids[0]), prepare.sampling.n or 1
        for j in range(n):
            yield pdserve_pb2.GenerateResponse(request_id=request.request_id, index=j,
                                               text=f"{first}{j}", token_ids=[ord(first) * 10 + j],
                                               finish_reason="length")
        size = len(prepare.prompt_token_ids)
        yield pdserve_pb2.GenerateResponse(request_id=request.request_id, usage=pdserve_pb2.Usage(
            prompt_tokens=size, completion_tokens=n, total_tokens=size + n,
            time_per_output_token_s=size / 100))
        self.answered.set()


async def _post(worker, body: dict, request_id: str = "b") -> tuple[int, str]:
    async with openai_router([worker]) as url, aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/completions", json={"model": "fake", **body},
                                headers={"X-Request-Id": request_id}) as reply:
            return reply.status, await reply.text()


PROMPTS = ["apple", "banana", "cherry!"]


def test_each_prompt_is_a_request_and_choices_come_in_prompt_order():
    worker = EchoesPrompt("d")
    status, text = run(_post(worker, {"prompt": PROMPTS, "n": 2}))
    assert status == 200, text
    reply = json.loads(text)
    assert [(c["index"], c["text"]) for c in reply["choices"]] == [
        (0, "a0"), (1, "a1"), (2, "b0"), (3, "b1"), (4, "c0"), (5, "c1")]
    assert reply["id"] == "cmpl-b"
    assert {r.request_id for name, r in worker.calls if name == "PrepareReceive"} == {"b-0", "b-1", "b-2"}
    usage = reply["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (18, 6, 24)
    assert usage["timings"]["time_per_output_token_s"] == 0.07  # the slowest prompt's


def test_a_streamed_batch_sends_every_choice_and_one_usage_at_the_end():
    status, text = run(_post(EchoesPrompt("d"), {"prompt": [[104, 105], "yo"], "stream": True,
                                                 "stream_options": {"include_usage": True}}))
    assert status == 200, text
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    choices = sorted((c["choices"][0]["index"], c["choices"][0]["text"]) for c in chunks if c["choices"])
    assert choices == [(0, "h0"), (1, "y0")]
    usages = [c["usage"] for c in chunks if c.get("usage")]
    assert len(usages) == 1 and not chunks[-1]["choices"]
    assert usages[0]["prompt_tokens"] == 4 and usages[0]["completion_tokens"] == 2
    # vLLM's continuous_usage_stats: every chunk also says the usage so far
    status, text = run(_post(EchoesPrompt("d"), {"prompt": [[104, 105], "yo"], "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}}))
    chunks = [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: {")]
    so_far = [(c["usage"]["prompt_tokens"], c["usage"]["completion_tokens"]) for c in chunks if c["choices"]]
    assert so_far == [(4, 1), (4, 2)] and chunks[-1]["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("stream", [False, True])
def test_return_token_ids_gives_each_choice_its_prompts_ids_and_its_own(stream):
    status, text = run(_post(EchoesPrompt("d"), {"prompt": [[104, 105], "yo"], "n": 2, "stream": stream,
                                                 "return_token_ids": True}))
    assert status == 200, text
    chunks = [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: {")] \
        if stream else [json.loads(text)]
    got: dict[int, dict] = {}
    for c in chunks:
        for choice in c["choices"]:
            mine = got.setdefault(choice["index"], {"token_ids": []})
            mine["token_ids"] += choice["token_ids"]
            if "prompt_token_ids" in choice:
                assert "prompt_token_ids" not in mine  # once per choice
                mine["prompt_token_ids"] = choice["prompt_token_ids"]
    yo = list(CharTokenizer().encode("yo"))
    assert got == {0: {"prompt_token_ids": [104, 105], "token_ids": [1040]},
                   1: {"prompt_token_ids": [104, 105], "token_ids": [1041]},
                   2: {"prompt_token_ids": yo, "token_ids": [1210]}, 3: {"prompt_token_ids": yo, "token_ids": [1211]}}
    status, text = run(_post(EchoesPrompt("d"), {"prompt": "hi", "return_token_ids": 1}))
    assert status == 400 and json.loads(text)["error"]["param"] == "return_token_ids"


def test_include_obfuscation_pads_every_chunk_to_whole_blocks_of_random_characters():
    from pdserve.router.openai_shape import BLOCK, MIN_PAD

    body = {"prompt": [[104, 105], "yo"], "stream": True, "stream_options": {"include_usage": True}}
    plain = run(_post(EchoesPrompt("d"), body))[1]
    status, text = run(_post(EchoesPrompt("d"), {**body, "stream_options": {"include_usage": True,
                                                                              "include_obfuscation": True}}))
    assert status == 200, text
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: {")]
    assert len(events) == len([line for line in plain.splitlines() if line.startswith("data: {")])
    for event in events:
        pad = json.loads(event).pop("obfuscation")
        assert len(event) % BLOCK == 0 and len(pad) >= MIN_PAD and pad.replace("-", "").replace("_", "").isalnum()
    # the same answer underneath: only the padding differs
    unpadded = [json.loads(e) for e in events]
    for chunk in unpadded:
        chunk.pop("obfuscation")
    choices = sorted((c["choices"][0]["index"], c["choices"][0]["text"]) for c in unpadded if c["choices"])
    assert choices == [(0, "h0"), (1, "y0")]


@pytest.mark.parametrize("options,stream,named", [
    ({"include_usage": True}, False, "only allowed when stream is true"),
    ({"include_usage": "yes"}, True, "object of booleans"),
    ({"continuous": True}, True, "object of booleans"),
    ({"continuous_usage_stats": True}, True, "needs include_usage"),
])
def test_stream_options_that_ask_for_what_cannot_be_are_a_400(options, stream, named):
    status, text = run(_post(EchoesPrompt("d"), {"prompt": "hi", "stream": stream, "stream_options": options}))
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] == "stream_options" and named in error["message"]


@pytest.mark.parametrize("prompt,message", [
    (["fine", ""], "prompt[1] is empty"),
    (["fine", "x" * 200], "prompt[1]: This model's maximum context length is 128 tokens. "
                          "However, you requested 216 tokens (200 in the prompt"),
    (["fine", [1, 999]], "prompt[1]: prompt token id 999 is outside the vocabulary"),
    (["fine", [1, -3]], "prompt[1] token ids must be non-negative, got -3"),
    ([["fine"]], "prompt[0] must be a string, a list of token ids"),
    ([[1, 2], 3], "prompt must be a string, a list of token ids"),
])
def test_a_bad_prompt_in_a_batch_is_a_400_naming_it_before_any_node_works(prompt, message):
    worker = EchoesPrompt("d")
    status, text = run(_post(worker, {"prompt": prompt}))
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] == "prompt" and message in error["message"]
    assert worker.calls == []


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_the_nodes_refuse_fails_the_batch_and_aborts_the_others(stream):
    async def scenario():
        worker = EchoesPrompt("d", gate=asyncio.Event())  # "ok" runs until the batch ends
        async with openai_router([worker]) as url, aiohttp.ClientSession() as session:
            async with session.post(f"{url}/v1/completions", headers={"X-Request-Id": "r"}, json={
                    "model": "fake", "prompt": ["ok", "!full"], "stream": stream}) as reply:
                status, body = reply.status, await reply.json()
            await reached(lambda: "r-0" in worker.aborted, "the running prompt aborted")
        return status, body, worker

    status, body, worker = run(scenario())
    assert status == 429 and body["error"]["code"] == "resource_exhausted"
    assert ("StartGeneration", "r-0") in [(n, c.request_id) for n, c in worker.calls]


def test_nothing_is_sent_before_every_prompt_began():
    """A prompt refused after another one's answer came still gives the batch its status."""
    status, text = run(_post(EchoesPrompt("d", late=True), {"prompt": ["ok", "!full"],
                                                            "stream": True}))
    assert status == 429, text


def test_a_client_that_leaves_aborts_every_prompt_of_its_batch():
    async def scenario():
        worker = EchoesPrompt("d", gate=asyncio.Event())  # never opens: the client leaves first
        async with openai_router([worker]) as url, aiohttp.ClientSession() as session:
            post = asyncio.create_task(session.post(
                f"{url}/v1/completions", headers={"X-Request-Id": "gone"},
                json={"model": "fake", "prompt": ["one", "two"], "stream": True}))
            started = lambda: sum(n == "StartGeneration" for n, _ in worker.calls) == 2  # noqa: E731
            await reached(started, "both prompts generating")
            post.cancel()
            await reached(lambda: {"gone-0", "gone-1"} <= set(worker.aborted),
                          "both prompts aborted")
        return worker

    assert {"gone-0", "gone-1"} <= set(run(scenario()).aborted)


def test_prompt_shapes():
    def prompts(prompt):
        return completion_prompts({"prompt": prompt}, lambda text: [ord(c) for c in text], 10)

    assert prompts("hi") == [[104, 105]]
    assert prompts([7, 8]) == [[7, 8]]
    assert prompts(["hi"]) == [[104, 105]]
    assert prompts(["a", [9]]) == [[97], [9]]
    with pytest.raises(OpenAIError, match="prompt is empty"):
        prompts([])
    with pytest.raises(OpenAIError, match="prompt must be"):
        prompts(None)
    with pytest.raises(OpenAIError, match=r"prompt\[1\] of 11 characters is longer than the "
                                          r"model's context can hold \(at most 10"):
        prompts(["a", "x" * 11])

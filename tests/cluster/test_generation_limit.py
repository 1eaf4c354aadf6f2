"""No hidden cut-off: a generation runs as long as its max_tokens and its client's deadline
allow. The router's `--generation-timeout-s` is off by default; set, it ends a generation
as max_tokens would, with finish_reason "length" and the text so far, on a stream and on a
whole answer alike (never a 503 that throws the text away).

The decode nodes of `fault_cluster` hold a `held-` request's stream at their "stream" gate
after its first tokens, so a generation outlasts the limit by an event, not by its speed:
the limited answer comes back while its stream is still held on the decode node.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest

from pdserve.cli import build_parser
from pdserve.client import AsyncClient
from pdserve.procs import free_port
from pdserve.router.config import RouterConfig
from pdserve.runtime.options import from_args
from tests.cluster.conftest import HELD, ROUTER_FLAGS
from tests.cluster.nodes import gate_open, run, stopped_at

PROMPT = [7] * 40
MAX_TOKENS = 400
GREEDY = dict(temperature=0.0, ignore_eos=True)
LIMIT_S = "2"
DECODES = ("d1", "d2")


@pytest.fixture(scope="module")
def cut(fault_cluster):
    """A router of its own over the fault cluster's nodes, with `--generation-timeout-s 2`."""
    c = fault_cluster
    port = free_port()
    c.start("cut", ["router", "--model", c.model, "--host", "127.0.0.1",
                    "--prefill", f"{c.address('p1')},{c.address('p2')}",
                    "--decode", f"{c.address('d1')},{c.address('d2')}", "--lease-ms", "8000",
                    "--generation-timeout-s", LIMIT_S, "--http-port", str(port), *ROUTER_FLAGS])
    yield f"http://127.0.0.1:{port}"
    c.stop_node("cut")


async def _collect(stream) -> list:
    return [m async for m in stream]


def _tokens(msgs) -> list[int]:
    return [t for m in msgs if not m.HasField("usage") for t in m.token_ids]


def test_the_limit_ends_a_stream_with_length_and_its_text_and_no_limit_is_the_default(
        fault_cluster, cut):
    c = fault_cluster
    args = build_parser().parse_args(["router", "--model", c.model, "--decode", "127.0.0.1:1"])
    assert from_args(RouterConfig, args, model=c.model).generation_timeout_s == 0  # off

    async def go():
        async with AsyncClient(c.address("main")) as main, AsyncClient(c.address("cut")) as limited:
            # The default router's request is held first, so it is held longer than the
            # limited one, which the limit ends; then both are let go.
            unlimited = asyncio.ensure_future(_collect(main.responses(
                PROMPT, request_id=f"{HELD}unlimited", max_tokens=MAX_TOKENS, **GREEDY)))
            first = await stopped_at(c, "stream", f"{HELD}unlimited", DECODES)
            cut_short = asyncio.ensure_future(_collect(limited.responses(
                PROMPT, request_id=f"{HELD}cut-stream", max_tokens=MAX_TOKENS, **GREEDY)))
            second = await stopped_at(c, "stream", f"{HELD}cut-stream", DECODES)
            short = await cut_short  # ended by the limit, its stream still held on the node
            await gate_open(c.address(second), "stream", f"{HELD}cut-stream")
            await gate_open(c.address(first), "stream", f"{HELD}unlimited")
            return await unlimited, short

    full, short = run(go(), timeout_s=300)
    assert [m.finish_reason for m in full if m.finish_reason] == ["length"]
    assert len(_tokens(full)) == MAX_TOKENS  # outlived the limit: served in full
    assert "generation-timeout" not in c.log_text("main")

    tokens = _tokens(short)
    assert [m.finish_reason for m in short if m.finish_reason] == ["length"]
    assert 1 <= len(tokens) < MAX_TOKENS
    assert short[-1].HasField("usage") and short[-1].usage.completion_tokens == len(tokens)
    assert tokens == _tokens(full)[:len(tokens)]  # what was generated, kept
    text = "".join(m.text for m in short)
    assert "".join(m.text for m in full).startswith(text)


def _post(url: str, body: dict, request_id: str) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={
        "Content-Type": "application/json", "X-Request-Id": request_id})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return reply.status, reply.read()


def _sse_events(raw: bytes) -> list:
    lines = [line[len(b"data: "):] for line in raw.split(b"\n\n") if line.startswith(b"data: ")]
    assert lines[-1] == b"[DONE]", lines[-1:]
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("stream", [False, True])
def test_the_limit_ends_an_openai_answer_with_length_and_what_was_generated(
        fault_cluster, cut, stream):
    c = fault_cluster
    request_id = f"{HELD}cut-http-{stream}"
    body = {"model": c.model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None, **GREEDY}

    async def go():
        answer = asyncio.ensure_future(asyncio.to_thread(
            _post, cut + "/v1/completions", body, request_id))
        node = await stopped_at(c, "stream", request_id, DECODES)
        got = await answer  # ended by the limit, its stream still held on the node
        await gate_open(c.address(node), "stream", request_id)
        return got

    status, raw = run(go(), timeout_s=300)
    assert status == 200
    if stream:
        events = _sse_events(raw)
        assert not any("error" in e for e in events), events
        choices = [e["choices"][0] for e in events if e["choices"]]
        finish = [ch["finish_reason"] for ch in choices if ch["finish_reason"]]
        text, usage = "".join(ch["text"] for ch in choices), events[-1]["usage"]
    else:
        whole = json.loads(raw)
        finish, text = [whole["choices"][0]["finish_reason"]], whole["choices"][0]["text"]
        usage = whole["usage"]
    assert finish == ["length"]
    assert 1 <= usage["completion_tokens"] < MAX_TOKENS

    async def greedy():
        async with AsyncClient(c.address("main")) as client:
            return await client.generate(PROMPT, max_tokens=MAX_TOKENS, **GREEDY)

    assert run(greedy(), timeout_s=300).text.startswith(text)  # what was generated, kept

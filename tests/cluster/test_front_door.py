"""The front door: a request the model cannot serve (a sampling value out of range, more
tokens than the context holds) is refused by the router itself, over gRPC and the OpenAI
API alike, in words a user can act on (vLLM's, for the context), naming no node and no
RPC; and no prefill or decode node ever sees it (their /metrics and their logs)."""

from __future__ import annotations

import re

import grpc
import openai
import pytest

from pdserve.client import AsyncClient
from tests.cluster.nodes import run, wait_until

PROMPT = [5] * 40  # token ids of the tiny model (vocabulary 512, context 512)
MESSAGES = [{"role": "user", "content": "name a fox, and then name another one"}]


def _context(requested: int, completion: int, prompt_in: str = "prompt", prompt: int = 40) -> str:
    return (f"This model's maximum context length is 512 tokens. However, you requested "
            f"{requested} tokens ({prompt} in the {prompt_in}, {completion} in the completion). "
            f"Please reduce the length of the {prompt_in} or completion.")


CASES = {
    "top_p": (dict(top_p=1.5, max_tokens=8), "top_p must be in (0, 1], got 1.5"),
    "max_tokens_beyond_context": (dict(max_tokens=100_000), _context(100_040, 100_000)),
    "prompt_and_max_tokens_over_context": (dict(max_tokens=480), _context(520, 480)),
}


def _node_requests(cluster) -> dict[str, float]:
    """Requests each worker has counted, whatever their outcome (a refusal counts too)."""
    return {node: sum(v for (name, _), v in cluster.scrape(node).items()
                      if name == "pdserve_requests_total")
            for node in ("prefill", "decode")}


def _settled(cluster) -> dict[str, float]:
    """The workers' counts once an earlier test's streams have all been recorded (a node
    records a stream's end just after its client saw it)."""
    seen: list = [None]

    def same():
        now = _node_requests(cluster)
        steady, seen[0] = now == seen[0], now
        return steady and now

    return wait_until(same, lambda: f"worker counters to settle (last {seen[0]})", timeout_s=60)


def _assert_front_door(cluster, before: dict, message: str, request_id: str) -> None:
    for word in ("127.0.0.1", "PrepareReceive", "RemoteSend", "StartGeneration", " node "):
        assert word not in message, message
    assert _node_requests(cluster) == before  # no worker counted it, not even as refused
    for node in ("prefill", "decode"):
        assert request_id not in cluster.log_text(node), node


@pytest.mark.parametrize("case", CASES)
def test_router_refuses_over_grpc_before_any_node_works(cluster, case):
    fields, expected = CASES[case]
    request_id = f"front-grpc-{case}"
    before = _settled(cluster)

    async def go():
        async with AsyncClient(cluster.grpc) as client:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.generate(PROMPT, request_id=request_id, timeout=30, **fields)
        return err.value

    err = run(go())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert err.details() == expected
    _assert_front_door(cluster, before, err.details(), request_id)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_router_refuses_over_the_openai_api_before_any_node_works(api, cluster, case, stream):
    fields, expected = CASES[case]
    request_id = f"front-http-{case}-{stream}"
    before = _settled(cluster)
    with pytest.raises(openai.BadRequestError) as err:
        api.completions.create(model=cluster.model, prompt=PROMPT, stream=stream,
                               extra_headers={"X-Request-Id": request_id}, **fields)
    body = err.value.body
    assert err.value.status_code == 400 and body["code"] == "invalid_argument"
    assert body["message"] == expected
    _assert_front_door(cluster, before, body["message"], request_id)


def test_a_conversation_over_the_context_is_refused_naming_the_messages(api, cluster):
    request_id = "front-chat-context"
    before = _settled(cluster)
    with pytest.raises(openai.BadRequestError) as err:
        api.chat.completions.create(model=cluster.model, messages=MESSAGES, max_tokens=500,
                                    extra_headers={"X-Request-Id": request_id})
    message = err.value.body["message"]
    found = re.fullmatch(r"This model's maximum context length is 512 tokens\. However, you "
                         r"requested (\d+) tokens \((\d+) in the messages, 500 in the "
                         r"completion\)\. Please reduce the length of the messages or "
                         r"completion\.", message)
    assert found, message
    assert int(found[1]) == int(found[2]) + 500 > 512
    _assert_front_door(cluster, before, message, request_id)


def test_a_request_that_just_fits_the_context_runs(cluster):
    """The bound is the context itself: 40 + 472 = 512 tokens is served in full."""
    async def go():
        async with AsyncClient(cluster.grpc) as client:
            return await client.generate(PROMPT, max_tokens=472, temperature=0.0,
                                         ignore_eos=True, timeout=120)

    out = run(go(), timeout_s=180)
    assert len(out.token_ids) == 472 and out.finish_reason == "length"


@pytest.mark.parametrize("case", CASES)
def test_a_colocated_node_refuses_the_same_way(colocated, case):
    fields, expected = CASES[case]

    async def go():
        async with AsyncClient(colocated.address) as client:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.generate(PROMPT, timeout=30, **fields)
        return err.value

    err = run(go())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details() == expected

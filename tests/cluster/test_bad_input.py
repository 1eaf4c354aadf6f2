"""Bad and random input at the router and at a worker: a clear status naming the value,
or a valid stream; never a hang or a crash, and the nodes serve normally afterwards."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pdserve.client import AsyncClient
from pdserve.runtime.server import channel
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from tests.cluster.conftest import SLOW
from tests.cluster.nodes import (GREEDY, full, gate_open, run, stopped_at, wait_pools_full,
                                 worker_stub)

VOCAB, MAX_LEN = 512, 512
OK = grpc.StatusCode.OK


@pytest.mark.parametrize("fields,named", [
    (dict(prompt=""), "prompt"),
    (dict(prompt_token_ids=[5] * MAX_LEN), "(512 in the prompt, 16 in the completion)"),
    (dict(prompt_token_ids=[5, VOCAB]), "512"),
    (dict(prompt_token_ids=[5, -1]), "-1"),
    (dict(prompt="hi", max_tokens=0), "max_tokens"),
    (dict(prompt="hi", max_tokens=MAX_LEN + 1), "513 in the completion"),
    (dict(prompt="hi", temperature=-0.5), "temperature"),
    (dict(prompt="hi", temperature=float("nan")), "temperature"),
    (dict(prompt="hi", top_p=0.0), "top_p"),
    (dict(prompt="hi", top_p=1.5), "top_p"),
    (dict(prompt="hi", top_k=-2), "top_k"),
    (dict(prompt="hi", n=0), "n must"),
    (dict(prompt="hi", n=10**6), "n must"),
    (dict(prompt="hi", stop_token_ids=[VOCAB]), "stop_token_ids"),
    (dict(prompt="hi", presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5"),
    (dict(prompt="hi", repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(prompt="hi", max_tokens=4, min_tokens=5), "min_tokens must be an integer in [0, max_tokens = 4], got 5"),
    (dict(prompt="hi", bad_words=[" "]), "bad_words must be at most 64 words, each with a non-space character"),
    (dict(prompt="hi", allowed_token_ids=[5, VOCAB]), f"allowed_token_ids must be token ids in [0, {VOCAB}), got {VOCAB}"),
    (dict(prompt="hi", min_tokens=2, structured_output={"regex": "a+"}),
     "min_tokens cannot be combined with structured_output"),
    (dict(prompt="hi", logit_bias={VOCAB: 1.0}), f"logit_bias must be keyed by token ids in [0, {VOCAB}), got {VOCAB}"),
    (dict(prompt="hi", logit_bias={7: -101.0}), "logit_bias[7] must be in [-100, 100], got -101.0"),
    (dict(prompt="hi", structured_output={"regex": "(ab"}), "structured_output.regex does not compile: Regex parsing"),
    (dict(prompt="hi", structured_output={"json_schema": "{oops"}), "structured_output.json_schema must be a JSON"),
    (dict(prompt="hi", structured_output={}), "structured_output must be one of json_schema"),
    (dict(prompt="hi", kv_window_end=50), "kv_window_end"),
    (dict(prompt="hi", request_id="x" * 300), "request_id"),
])
def test_router_names_the_bad_value(fault_cluster, fields, named):
    fields = dict(fields)
    prompt = fields.pop("prompt", None)
    prompt = prompt if prompt is not None else fields.pop("prompt_token_ids")

    async def go():
        async with AsyncClient(fault_cluster.address("main")) as client:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.generate(prompt, timeout=10, **fields)
        return err.value

    err = run(go())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert named in err.details(), err.details()


def test_duplicate_request_id_and_oversized_message(fault_cluster):
    async def go():
        async with AsyncClient(fault_cluster.address("main")) as client:
            first = asyncio.ensure_future(client.generate("hello", request_id=f"{SLOW}twice",
                                                          max_tokens=8, **GREEDY))
            prefill = await stopped_at(fault_cluster, "prefill", f"{SLOW}twice")
            with pytest.raises(grpc.aio.AioRpcError) as dup:
                await client.generate("hello", request_id=f"{SLOW}twice", timeout=10)
            assert await client.abort(f"{SLOW}twice")
            await gate_open(fault_cluster.address(prefill), "prefill", f"{SLOW}twice")
            with pytest.raises(grpc.aio.AioRpcError):
                await first
            with pytest.raises(grpc.aio.AioRpcError) as big:
                await client.generate("x" * (65 * 1024 * 1024), timeout=30)
            unknown = await client.abort("never-seen")
        return dup.value, big.value, unknown

    dup, big, unknown = run(go())
    assert dup.code() == grpc.StatusCode.INVALID_ARGUMENT and "twice" in dup.details()
    assert big.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert unknown is False  # Abort is idempotent: an unknown id is "not found", not an error


token_ids = st.one_of(st.lists(st.integers(0, VOCAB - 1), min_size=2, max_size=40),
                      st.lists(st.integers(-5, VOCAB + 5), max_size=40))
sampling = st.fixed_dictionaries({}, optional={
    "max_tokens": st.integers(-2, MAX_LEN + 2), "temperature": st.floats(-1, 3),
    "top_p": st.floats(-0.5, 1.5), "top_k": st.integers(-3, 600), "n": st.integers(-1, 20),
    "min_p": st.floats(-0.5, 1.5), "logprobs": st.integers(-1, 30),
    "seed": st.integers(0, 2**64 - 1), "ignore_eos": st.booleans(),
    "stop": st.lists(st.text(max_size=5), max_size=3),
    "stop_token_ids": st.lists(st.integers(-2, VOCAB + 2), max_size=3),
    "min_tokens": st.integers(-2, 10), "bad_words": st.lists(st.text(max_size=6), max_size=3),
    "allowed_token_ids": st.lists(st.integers(-2, VOCAB + 2), max_size=3),
})
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))


async def _outcome(call) -> grpc.StatusCode:
    """The call's status; a stream must end with exactly one usage message."""
    try:
        result = await asyncio.wait_for(call, 30)
    except grpc.aio.AioRpcError as err:
        assert err.code() != grpc.StatusCode.UNKNOWN, err.details()  # no unhandled crash
        assert err.code() != grpc.StatusCode.INTERNAL, err.details()
        return err.code()
    if isinstance(result, list):
        assert result and result[-1].HasField("usage")
        assert not any(m.HasField("usage") for m in result[:-1])
    return OK


async def _collect(call):
    return [m async for m in call]


def test_random_requests_to_the_router_get_a_status_or_a_valid_stream(fault_cluster):
    seen: dict = {}

    @SETTINGS
    @given(ids=token_ids, text=st.text(max_size=30), use_text=st.booleans(), params=sampling,
           window=st.one_of(st.none(), st.integers(-50, 50)),
           request_id=st.text(max_size=8))
    def one(ids, text, use_text, params, window, request_id):
        async def go():
            async with channel(fault_cluster.address("main")) as ch:
                stub = pdserve_pb2_grpc.GenerationStub(ch)
                request = pdserve_pb2.GenerateRequest(
                    request_id=request_id, sampling=pdserve_pb2.SamplingParams(
                        **{**params, "max_tokens": min(params.get("max_tokens", 4), 8)}))
                if use_text:
                    request.prompt = text
                else:
                    request.prompt_token_ids.extend(ids)
                if window is not None:
                    request.kv_window_end = window
                return await _outcome(_collect(stub.Generate(request, timeout=30)))

        code = run(go(), timeout_s=60)
        seen[code] = seen.get(code, 0) + 1
        assert code in (OK, grpc.StatusCode.INVALID_ARGUMENT), code

    one()
    assert seen.get(OK) and seen.get(grpc.StatusCode.INVALID_ARGUMENT), seen
    _still_serves(fault_cluster)


def test_random_requests_to_a_worker_get_a_status(fault_cluster):
    decode, prefill = fault_cluster.address("d1"), fault_cluster.address("p1")
    rpcs = st.sampled_from(["PrepareReceive", "RemoteSend", "StartGeneration", "Abort"])
    seen: dict = {}

    sane_call = dict(ids=[1, 2, 3], params={}, end=-1, begin=0, meta=[], lease_ms=0,
                     request_id="a", lease_id="", expect=False, sane=True)

    @SETTINGS
    @example(rpc="PrepareReceive", **sane_call)  # whatever the draw, each path is exercised
    @example(rpc="PrepareReceive", **{**sane_call, "sane": False, "end": 40})
    @example(rpc="RemoteSend", **sane_call)
    @given(rpc=rpcs, ids=token_ids, params=st.one_of(st.just({}), sampling),
           end=st.integers(-45, 45),
           begin=st.integers(-5, 45), meta=st.lists(st.integers(-3, 2000), max_size=7),
           lease_ms=st.one_of(st.just(0), st.integers(-5, 3000)),
           request_id=st.sampled_from(["", "a", "b", "c" * 300]),
           lease_id=st.sampled_from(["", "nope"]), expect=st.booleans(), sane=st.booleans())
    def one(rpc, ids, params, end, begin, meta, lease_ms, request_id, lease_id, expect, sane):
        if sane:  # half the calls well-formed, so the valid path is exercised too
            ids, params, request_id, lease_ms = [7, 8, 9, *ids[:20]], {}, "a", 0
            ids = [t % VOCAB for t in ids]
            end = max(-len(ids), min(end, len(ids) - 1))

        async def go():
            async with channel(decode) as dch, channel(prefill) as pch:
                d, p = worker_stub(dch), worker_stub(pch)
                sp = pdserve_pb2.SamplingParams(**params)
                if rpc == "PrepareReceive":
                    call = d.PrepareReceive(pdserve_pb2.PrepareReceiveRequest(
                        request_id=request_id, prompt_token_ids=ids, sampling=sp,
                        kv_window_end=end, lease_ms=lease_ms), timeout=30)
                elif rpc == "RemoteSend":
                    call = p.RemoteSend(pdserve_pb2.RemoteSendRequest(
                        request_id=request_id, prompt_token_ids=ids, kv_window_begin=begin,
                        kv_window_end=end, kv_append_metadata=meta, lease_id=lease_id,
                        decode_agent_name="not-a-peer", decode_address=decode,
                        lease_remaining_ms=60_000), timeout=30)
                elif rpc == "StartGeneration":
                    call = _collect(d.StartGeneration(pdserve_pb2.StartGenerationRequest(
                        request_id=request_id, kv_window_begin=begin, lease_id=lease_id,
                        expect_kv_notification=expect), timeout=30))
                else:
                    call = d.Abort(pdserve_pb2.AbortRequest(request_id=request_id), timeout=30)
                code = await _outcome(call)
                # Whatever was reserved is given back, as the router would.
                await d.Abort(pdserve_pb2.AbortRequest(request_id=request_id,
                                                       kv_write_settled=True), timeout=10)
                return code

        code = run(go(), timeout_s=60)
        seen[(rpc, code)] = seen.get((rpc, code), 0) + 1
        assert code in (OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                        grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED), \
            (rpc, code)

    one()
    assert ("PrepareReceive", OK) in seen and ("PrepareReceive", grpc.StatusCode.INVALID_ARGUMENT) in seen, seen
    reports = run(wait_pools_full([decode, prefill]))
    assert all(full(r) for r in reports), reports
    _still_serves(fault_cluster)


def _still_serves(cluster):
    async def go():
        async with AsyncClient(cluster.address("main")) as client:
            return await client.generate("a normal request after the storm", max_tokens=5,
                                         timeout=30, **GREEDY)

    out = run(go())
    assert len(out.token_ids) == 5 and out.finish_reason == "length"

"""Conversations at the router, in-process over fake workers (no model runs): `chat_ids`
renders the model's chat template as a hand-templated prompt would be, bad messages are
refused naming the value (gRPC INVALID_ARGUMENT, HTTP 400), the end-of-turn token is found
even where it is not the eos, and a conversation reaches the decode node with it as a stop
token (unless ignore_eos), through gRPC and the OpenAI API alike."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import grpc
import pytest

from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch import Dispatcher
from pdserve.router.openai_http import OpenAIFrontend
from pdserve.router.policies import RoundRobin
from pdserve.router.registry import WorkerRegistry
from pdserve.router.service import GenerationService
from pdserve.router.tokenizer import PromptTokenizer
from pdserve.runtime.http import start_http
from tests.chat_checkpoint import (INST_TEMPLATE, write_chatml_tokenizer,
                                   write_tokenizer_only)
from tests.router.fake_worker import FakeWorker, run, start_fake

CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name a fox"},
                {"role": "assistant", "content": "the quick brown fox"},
                {"role": "user", "content": "and a dog"}]
EOS = 2


@pytest.fixture(scope="module")
def tiny(tiny_model) -> PromptTokenizer:
    return PromptTokenizer(tiny_model)


@pytest.fixture(scope="module")
def chatml(tmp_path_factory) -> tuple[PromptTokenizer, int]:
    """Turns end with <|im_end|>, the eos is <|eos|>: (its tokenizer, <|im_end|>'s id)."""
    out = write_tokenizer_only(tmp_path_factory.mktemp("chatml"), None)
    end_of_turn = write_chatml_tokenizer(out)
    return PromptTokenizer(str(out)), end_of_turn


def test_chat_ids_are_the_template_rendered_by_hand(tiny, tiny_model):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_model)
    text = hf.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert text == ("<|system|>be brief<|eos|><|user|>name a fox<|eos|><|assistant|>the quick "
                    "brown fox<|eos|><|user|>and a dog<|eos|><|assistant|>")
    assert tiny.chat_ids(CONVERSATION) == hf.encode(text, add_special_tokens=False)
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in CONVERSATION]
    assert tiny.chat_ids(parts) == tiny.chat_ids(CONVERSATION)  # OpenAI's text parts


@pytest.mark.parametrize("messages,named", [
    ([], "messages must be a non-empty list of {role, content} objects, got []"),
    (None, "got None"),
    ("hello", "got 'hello'"),
    (["hello"], "messages[0] must be an object with a role and a content, got 'hello'"),
    ([{"content": "hi"}], "messages[0].role must be a non-empty string, got None"),
    ([{"role": "", "content": "hi"}], "messages[0].role must be a non-empty string, got ''"),
    ([{"role": 7, "content": "hi"}], "messages[0].role must be a non-empty string, got 7"),
    ([{"role": "user", "content": "a"}, {"role": "user"}],
     "messages[1].content must be a string or a list of text parts, got None"),
    ([{"role": "user", "content": 5}], "messages[0].content must be a string or a list of text "
                                       "parts, got 5"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "image_url"),
    ([{"role": "user", "content": "x" * 512 * 64 + "x"}], "32769 characters"),
])
def test_bad_messages_are_refused_naming_the_value(tiny, messages, named):
    with pytest.raises(ValueError) as err:
        tiny.chat_ids(messages)
    assert named in str(err.value)


def test_a_checkpoint_without_a_chat_template_is_refused_naming_the_model(tmp_path):
    bare = PromptTokenizer(str(write_tokenizer_only(tmp_path, None)))
    with pytest.raises(ValueError, match=f"model {tmp_path} has no chat template"):
        bare.chat_ids([{"role": "user", "content": "hi"}])
    assert bare.end_of_turn_ids == [EOS]


def test_end_of_turn_is_the_eos_when_the_template_ends_turns_with_it(tiny):
    assert tiny.end_of_turn_ids == [EOS]


def test_end_of_turn_is_the_token_closing_a_turn_when_it_is_not_the_eos(chatml):
    tokenizer, end_of_turn = chatml
    assert tokenizer.card.eos_token_ids == [EOS]
    assert tokenizer.end_of_turn_ids == [EOS, end_of_turn]


def test_end_of_turn_is_what_closes_an_answer_not_a_user_turn(tmp_path):
    inst = PromptTokenizer(str(write_tokenizer_only(tmp_path, INST_TEMPLATE)))
    closes_user_turn = inst.tokenizer.convert_tokens_to_ids("<|assistant|>")
    assert inst.chat_ids([{"role": "user", "content": "hi"}])[-1] == closes_user_turn
    assert inst.end_of_turn_ids == [EOS]


def test_generation_config_eos_ids_end_a_turn_too(tmp_path):
    out = write_tokenizer_only(tmp_path, None)
    (Path(out) / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, 9]}))
    assert PromptTokenizer(str(out)).end_of_turn_ids == [EOS, 9]


async def _router(tokenizer: PromptTokenizer, decode: FakeWorker, call):
    """`await call(grpc_address, http_base)` against a router over one fake decode node."""
    worker, address = await start_fake(decode)
    registry = WorkerRegistry([], [address], RoundRobin(), RoundRobin())
    dispatcher = Dispatcher(RouterConfig(model="fake", decode=[address]), registry)
    server = grpc.aio.server()
    pdserve_pb2_grpc.add_GenerationServicer_to_server(GenerationService(dispatcher, tokenizer), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    http = await start_http(OpenAIFrontend(dispatcher, tokenizer, "fake").app(), "127.0.0.1", 0, "test")
    try:
        return await call(f"127.0.0.1:{port}", f"http://127.0.0.1:{http.addresses[0][1]}")
    finally:
        await http.cleanup()
        await registry.close()
        await server.stop(None)
        await worker.stop(None)


def generate(tokenizer, request: pdserve_pb2.GenerateRequest) -> FakeWorker:
    """Send `request` over gRPC; the fake decode node, which recorded what reached it."""
    decode = FakeWorker("d")

    async def call(address, _):
        async with grpc.aio.insecure_channel(address) as ch:
            async for _ in pdserve_pb2_grpc.GenerationStub(ch).Generate(request, timeout=10):
                pass

    run(_router(tokenizer, decode, call))
    return decode


def chat_request(messages, **sampling) -> pdserve_pb2.GenerateRequest:
    return pdserve_pb2.GenerateRequest(
        messages=[pdserve_pb2.ChatMessage(**m) for m in messages],
        sampling=pdserve_pb2.SamplingParams(**sampling))


def test_a_grpc_conversation_reaches_decode_templated_and_stopping_at_its_end_of_turn(chatml):
    tokenizer, end_of_turn = chatml
    decode = generate(tokenizer, chat_request(CONVERSATION, stop_token_ids=[7]))
    (_, prepare), _ = decode.calls
    assert list(prepare.prompt_token_ids) == tokenizer.chat_ids(CONVERSATION)
    assert list(prepare.sampling.stop_token_ids) == [7, EOS, end_of_turn]


def test_ignore_eos_and_plain_prompts_get_no_end_of_turn_stop(chatml):
    tokenizer, _ = chatml
    ignoring = generate(tokenizer, chat_request(CONVERSATION, ignore_eos=True))
    prompt = generate(tokenizer, pdserve_pb2.GenerateRequest(prompt="<|user|>hi<|im_end|>"))
    for decode in (ignoring, prompt):
        assert list(decode.calls[0][1].sampling.stop_token_ids) == []


@pytest.mark.parametrize("request_fields,named", [
    (dict(messages=[pdserve_pb2.ChatMessage(content="hi")]), "messages[0].role must be a non-empty "
                                                             "string, got ''"),
    (dict(messages=[pdserve_pb2.ChatMessage(role="user")]), "messages[0].content must be a string "
                                                            "or a list of text parts, got None"),
    (dict(prompt="hi", messages=[pdserve_pb2.ChatMessage(role="user", content="hi")]),
     "give exactly one of prompt, prompt_token_ids or messages, got prompt and messages"),
])
def test_bad_grpc_messages_are_invalid_argument_naming_the_value(tiny, request_fields, named):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        generate(tiny, pdserve_pb2.GenerateRequest(**request_fields))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in err.value.details()


def post_chat(tokenizer, body: dict) -> tuple[int, dict, FakeWorker]:
    decode = FakeWorker("d")

    async def call(_, http):
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{http}/v1/chat/completions",
                                    json={"model": "fake", **body}) as reply:
                return reply.status, await reply.json()

    status, reply = run(_router(tokenizer, decode, call))
    return status, reply, decode


def test_an_openai_chat_stops_at_the_end_of_turn_as_a_grpc_conversation_does(chatml):
    tokenizer, end_of_turn = chatml
    status, _, decode = post_chat(tokenizer, {"messages": CONVERSATION, "max_tokens": 3})
    assert status == 200
    prepare = decode.calls[0][1]
    assert list(prepare.prompt_token_ids) == tokenizer.chat_ids(CONVERSATION)
    assert list(prepare.sampling.stop_token_ids) == [EOS, end_of_turn]


def test_bad_openai_messages_are_400s_naming_the_value(tiny):
    status, reply, decode = post_chat(tiny, {"messages": [{"role": "user", "content": 5}]})
    assert status == 400 and decode.calls == []
    assert reply["error"]["param"] == "messages"
    assert reply["error"]["message"] == ("messages[0].content must be a string or a list of "
                                         "text parts, got 5")

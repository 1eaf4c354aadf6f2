"""Conversations end to end, over real processes: a gRPC `messages` request through router +
prefill + decode gives the tokens of the same conversation templated by hand, bad messages
are refused naming the value while other requests go on, a served conversation stops at an
end-of-turn token that is not the eos, and `pdserve chat` carries the conversation from turn
to turn (with the real SmolLM2 model, it knows the capital of France), its stdout the
answers alone (tests/cluster/test_chat_terminal.py runs it on a terminal)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import grpc
import pytest

from pdserve.client import AsyncClient
from pdserve.proto import pdserve_pb2
from pdserve.router.tokenizer import PromptTokenizer
from tests.chat_checkpoint import answer_with_end_of_turn_first, write_chatml_tokenizer
from tests.cluster.nodes import WORKER_FLAGS, Cluster, run, wait_until

CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name a fox"}]
GREEDY = dict(temperature=0.0, max_tokens=8)


def test_grpc_messages_give_the_tokens_of_the_conversation_templated_by_hand(cluster):
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(cluster.model).apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True)

    async def both():
        async with AsyncClient(cluster.grpc) as client:
            return (await client.generate(messages=CONVERSATION, **GREEDY),
                    await client.generate(text, **GREEDY))

    chat, by_hand = run(both())
    assert chat.token_ids == by_hand.token_ids and len(chat.token_ids) > 0
    assert chat.usage.prompt_tokens == by_hand.usage.prompt_tokens
    assert chat.usage.route.decode_endpoint == cluster.address("decode")


@pytest.mark.parametrize("messages,named", [
    ([{"content": "hi"}], "messages[0].role must be a non-empty string, got ''"),
    ([{"role": "user", "content": "a"}, {"role": "assistant"}],
     "messages[1].content must be a string or a list of text parts, got None"),
])
def test_bad_messages_are_invalid_argument_while_other_requests_go_on(cluster, messages, named):
    async def go():
        async with AsyncClient(cluster.grpc) as client:
            long = asyncio.ensure_future(client.generate(
                messages=CONVERSATION, temperature=0.0, max_tokens=48, ignore_eos=True))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.generate(messages=messages, timeout=10)
            return err.value, await long

    err, long = run(go())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and named in err.details()
    assert long.finish_reason == "length" and len(long.token_ids) == 48


@pytest.fixture(scope="module")
def end_of_turn_node(tmp_path_factory):
    """A `serve` node over a tiny checkpoint whose turns end with <|im_end|> (not its eos,
    <|eos|>), edited to answer CONVERSATION with <|im_end|> first: (address, tokenizer,
    <|im_end|>'s id)."""
    from pdserve.engine.checkpoint import write_checkpoint

    model = tmp_path_factory.mktemp("end-of-turn-model")
    write_checkpoint(model, family="llama", seed=0, vocab_size=512, hidden_size=64,
                     intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=512)
    end_of_turn = write_chatml_tokenizer(model)
    tokenizer = PromptTokenizer(str(model))
    answer_with_end_of_turn_first(model, tokenizer.chat_ids(CONVERSATION), end_of_turn)
    node = Cluster(tmp_path_factory.mktemp("end-of-turn-logs"), str(model))
    try:
        yield node.start("both", ["serve", "--model", str(model), "--host", "127.0.0.1",
                                  *WORKER_FLAGS]).address, tokenizer, end_of_turn
    finally:
        node.stop()


def test_a_conversation_stops_at_its_end_of_turn_even_where_it_is_not_the_eos(end_of_turn_node):
    address, tokenizer, end_of_turn = end_of_turn_node
    assert end_of_turn not in tokenizer.card.eos_token_ids

    async def ask():
        async with AsyncClient(address) as client:
            return (await client.generate(messages=CONVERSATION, **GREEDY),
                    await client.generate(tokenizer.chat_ids(CONVERSATION), **GREEDY),
                    await client.generate(messages=CONVERSATION, ignore_eos=True, **GREEDY))

    chat, same_ids_as_prompt, ignoring_eos = run(ask())
    assert (chat.finish_reason, chat.token_ids, chat.text) == ("stop", [end_of_turn], "")
    # The same ids without the conversation: <|im_end|> comes first, and nothing stops there.
    assert same_ids_as_prompt.token_ids[0] == end_of_turn
    assert same_ids_as_prompt.finish_reason == "length" and len(same_ids_as_prompt.token_ids) == 8
    assert ignoring_eos.finish_reason == "length" and ignoring_eos.token_ids[0] == end_of_turn


def pdserve_chat(server: str, lines: list[str], *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cli", "chat", "--server", server, *flags],
                          input="".join(f"{line}\n" for line in lines), capture_output=True,
                          text=True, timeout=300)


def router_requests(cluster) -> list[dict]:
    return [r for r in map(json.loads, filter(None, cluster.log_lines("router")))
            if r["logger"] == "pdserve.request"]


def greedy_answers(cluster, *conversations: list[dict], max_tokens: int = 6) -> list[str]:
    async def ask():
        async with AsyncClient(cluster.grpc) as client:
            return [(await client.generate(messages=c, temperature=0.0,
                                           max_tokens=max_tokens)).text for c in conversations]

    return run(ask())


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def test_pdserve_chat_sends_the_conversation_so_far_each_turn(cluster):
    (first,) = greedy_answers(cluster, [user("name a fox")])
    history = [user("name a fox"), {"role": "assistant", "content": first}, user("and a dog")]
    (second,) = greedy_answers(cluster, history)
    seen = len(router_requests(cluster))

    out = pdserve_chat(cluster.grpc, ["name a fox", "and a dog"],
                       "--temperature", "0", "--max-tokens", "6")
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"{first}\n{second}\n"
    turns = wait_until(lambda: router_requests(cluster)[seen:] if
                       len(router_requests(cluster)) >= seen + 2 else None, "the chat's two requests")
    tokenizer = PromptTokenizer(cluster.model)
    assert [t["prompt_tokens"] for t in turns] == [len(tokenizer.chat_ids([user("name a fox")])),
                                                   len(tokenizer.chat_ids(history))]
    # one prompt_cache_key for the session: its turns go to the nodes holding the last
    assert turns[0]["prompt_cache_key"] == turns[1]["prompt_cache_key"] != ""


def test_pdserve_chat_goes_on_after_an_error_and_forgets_on_reset(cluster):
    (answer,) = greedy_answers(cluster, [user("name a fox")])
    seen = len(router_requests(cluster))
    too_long = "x" * (512 * 64 + 1)

    out = pdserve_chat(cluster.grpc, [too_long, "name a fox", "/reset", "name a fox", "/exit",
                                      "never sent"], "--temperature", "0", "--max-tokens", "6")
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines() == [
        "error: INVALID_ARGUMENT: messages of 32769 characters are longer than the model's "
        "context can hold (at most 32768 characters)",
        "[answer cut at --max-tokens 6]", "conversation forgotten",
        "[answer cut at --max-tokens 6]"]
    assert out.stdout == f"{answer}\n{answer}\n"  # the answers and nothing else
    turns = wait_until(lambda: router_requests(cluster)[seen:] if
                       len(router_requests(cluster)) >= seen + 3 else None, "the chat's requests")
    one_turn = len(PromptTokenizer(cluster.model).chat_ids([user("name a fox")]))
    assert [(t["outcome"], t.get("prompt_tokens")) for t in turns] == [
        ("invalid_argument", None), ("length", one_turn), ("length", one_turn)]


def test_pdserve_chat_with_smollm2_knows_the_capital_of_france(real_model, tmp_path):
    node = Cluster(tmp_path, real_model)
    try:
        both = node.start("both", ["serve", "--model", real_model, "--host", "127.0.0.1",
                                   *WORKER_FLAGS])
        out = pdserve_chat(both.address, ["What is the capital of France?"],
                           "--temperature", "0", "--max-tokens", "48")
    finally:
        node.stop()
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout, out.stdout

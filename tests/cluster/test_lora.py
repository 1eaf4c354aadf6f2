"""LoRA adapters served by a real cluster (`pdserve up --lora-modules`): a request naming an
adapter runs with it on the prefill node and on the decode node, its KV window moving
between them as any other's, and its greedy tokens equal PEFT's on transformers; the
model's own name runs the model alone; /v1/models lists the adapters with the model as their
parent; a name nobody serves is 404 over HTTP and NOT_FOUND over gRPC, naming what is
served. Nodes whose adapters differ have different model hashes, so a router never pairs
them (runtime/identity.py)."""

from __future__ import annotations

import re

import grpc
import openai
import pytest

from pdserve.client import AsyncClient
from pdserve.engine.checkpoint import write_lora_adapter
from pdserve.procs import NodeProcess
from pdserve.runtime.identity import model_hash
from tests.cluster.nodes import run
from tests.engine.test_lora import peft_greedy

PROMPT = list(range(3, 43))  # 40 tokens: five pages of 8, a window worth sending
NEW = 6


@pytest.fixture(scope="module")
def lora_up(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-up")
    adapters = {"alpha": write_lora_adapter(tiny_model, root / "alpha", seed=1),
                "beta": write_lora_adapter(tiny_model, root / "beta", seed=2, targets=("q_proj", "v_proj", "down_proj"))}
    node = NodeProcess(["up", "--model", tiny_model, "--port", "0", "--http-port", "0", "--page-size", "8",
                        "--num-pages", "128", "--lora-modules", *(f"{n}={d}" for n, d in adapters.items())],
                       log=root / "up.log")
    try:
        node.wait_ready()
        http = re.search(r"OpenAI API on (http://\S+:\d+/v1)", node.ready_line).group(1)
        yield node, http, adapters
    finally:
        node.stop()


def test_each_adapters_requests_run_with_it_through_prefill_and_decode(lora_up, tiny_model):
    node, http, adapters = lora_up

    async def ask():
        async with AsyncClient(node.address) as client:
            return [await client.generate(PROMPT, model=model, max_tokens=NEW, temperature=0.0, ignore_eos=True)
                    for model in ("alpha", "beta", "", "alpha")]

    outs = run(ask())
    want = {m: peft_greedy(tiny_model, adapters.get(m), PROMPT, NEW) for m in ("alpha", "beta", "")}
    assert [o.choices[0].token_ids for o in outs] == [want["alpha"], want["beta"], want[""], want["alpha"]]
    assert len({tuple(w) for w in want.values()}) == 3  # each adapter changes the answer
    for out in outs[:3]:  # KV computed by the prefill node, under the adapter, sent to decode
        route = out.usage.route
        assert route.prefill_endpoint and route.kv_window_end > route.kv_window_begin, route
    assert outs[3].usage.route.prefix_matched_length > 0  # alpha's own pages, found again
    with openai.OpenAI(base_url=http, api_key="unused", max_retries=0, timeout=60) as api:
        listed = api.models.list().data
        chat = api.completions.create(model="beta", prompt=PROMPT, max_tokens=NEW, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [(m.id, getattr(m, "parent", None)) for m in listed] == [
        (listed[0].id, None), ("alpha", listed[0].id), ("beta", listed[0].id)]
    assert chat.model == "beta" and chat.choices[0].token_ids == want["beta"]


def test_a_model_nobody_serves_is_not_found_naming_the_served_ones(lora_up):
    node, http, _ = lora_up
    with openai.OpenAI(base_url=http, api_key="unused", max_retries=0, timeout=60) as api:
        with pytest.raises(openai.NotFoundError, match="alpha"):
            api.completions.create(model="gamma", prompt="hi", max_tokens=1)

    async def ask():
        async with AsyncClient(node.address) as client:
            return await client.generate("hi", model="gamma", max_tokens=1)

    with pytest.raises(grpc.aio.AioRpcError) as err:
        run(ask())
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "model 'gamma' is not served here" in err.value.details() and "'alpha', 'beta'" in err.value.details()


def test_nodes_with_other_adapters_have_other_model_hashes(lora_up, tiny_model):
    _, _, adapters = lora_up
    alpha, beta = (f"{n}={d}" for n, d in adapters.items())
    hashes = [model_hash(tiny_model, mods) for mods in ([], [alpha], [alpha, beta], [f"beta={adapters['alpha']}"])]
    assert len(set(hashes)) == 4 and model_hash(tiny_model, [alpha]) == hashes[1]
    assert all(h.partition("+")[0] == hashes[0] for h in hashes)  # the checkpoint's part is the model alone's


def test_a_colocated_node_serves_its_adapters_too(lora_up, tiny_model, tmp_path):
    _, _, adapters = lora_up
    node = NodeProcess(["serve", "--model", tiny_model, "--host", "127.0.0.1", "--port", "0", "--page-size", "8",
                        "--num-pages", "64", "--lora-modules", f"alpha={adapters['alpha']}"], log=tmp_path / "serve.log")
    try:
        node.wait_ready()

        async def ask():
            async with AsyncClient(node.address) as client:
                return await client.generate(PROMPT, model="alpha", max_tokens=NEW, temperature=0.0, ignore_eos=True)

        assert run(ask()).choices[0].token_ids == peft_greedy(tiny_model, adapters["alpha"], PROMPT, NEW)
    finally:
        node.stop()

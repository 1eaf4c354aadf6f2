"""Router + prefill + decode as separate processes on loopback, against the colocated
node and transformers."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.client import AsyncClient
from tests.cluster.nodes import load, run, wait_pools_full

GREEDY = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [
    "the quick brown fox jumps over the lazy dog",
    "a model token cache page prefill decode router node",
    "winter light over the mountain city",
    "42",
]


def hf_greedy(model_dir: str, prompt_ids: list[int], n: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def test_greedy_output_equals_colocated_and_transformers(cluster, colocated, tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)

    async def go():
        async with AsyncClient(cluster.address("router")) as r, AsyncClient(colocated.address) as c:
            return [(await r.generate(p, **GREEDY), await c.generate(p, **GREEDY)) for p in PROMPTS]

    for prompt, (disagg, coloc) in zip(PROMPTS, run(go())):
        expected = hf_greedy(tiny_model, tok.encode(prompt), GREEDY["max_tokens"])
        assert disagg.token_ids == coloc.token_ids == expected, prompt
        assert disagg.text == coloc.text
        assert disagg.finish_reason == coloc.finish_reason == "length"


def test_32_concurrent_streams_all_complete(cluster):
    async def go():
        async with AsyncClient(cluster.address("router")) as client:
            return await asyncio.gather(*(
                client.generate(f"{PROMPTS[i % 4]} {i}", temperature=0.8, seed=i, max_tokens=6,
                                ignore_eos=True) for i in range(32)))

    outs = run(go(), timeout_s=300)
    assert all(len(o.token_ids) == 6 and o.finish_reason == "length" for o in outs)
    assert all(o.usage.completion_tokens == 6 for o in outs)


def test_stream_order_and_final_usage_message(cluster):
    async def go():
        async with AsyncClient(cluster.address("router")) as client:
            return [m async for m in client.responses(PROMPTS[0], request_id="order-1", **GREEDY)]

    msgs = run(go())
    *content, final = msgs
    assert final.HasField("usage") and not final.token_ids and not final.text
    assert not any(m.HasField("usage") for m in content)
    assert [bool(m.finish_reason) for m in content] == [False] * (len(content) - 1) + [True]
    tokens = [t for m in content for t in m.token_ids]
    assert len(tokens) == GREEDY["max_tokens"]
    usage = final.usage
    assert usage.completion_tokens == len(tokens)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.time_to_first_token_s > 0
    assert usage.route.decode_endpoint == cluster.address("decode")
    assert usage.route.prefill_endpoint == cluster.address("prefill")
    assert all(m.request_id == "order-1" for m in msgs)


def test_shared_prefix_gets_decode_prefix_hit_and_remote_send_starts_past_it(cluster, colocated):
    prefix = " ".join(["river mountain city light shadow window garden music"] * 4)

    async def go():
        async with AsyncClient(cluster.address("router")) as r, AsyncClient(colocated.address) as c:
            first = await r.generate(prefix + " paper letter", **GREEDY)
            second = await r.generate(prefix + " story market winter", **GREEDY)
            expected = await c.generate(prefix + " story market winter", **GREEDY)
            return first, second, expected, await load(cluster.address("prefill"))

    _, second, expected, prefill_load = run(go())
    route = second.usage.route
    assert route.prefix_matched_length >= 24  # page size 8: whole pages of the shared prefix
    assert route.kv_window_begin == route.prefix_matched_length > 0
    assert not route.remote_send_skipped
    assert prefill_load.last_kv_window_begin == route.kv_window_begin
    assert second.token_ids == expected.token_ids


@pytest.mark.parametrize("k", [2, 5])
def test_kv_window_end_minus_k_gives_the_same_output(cluster, colocated, k):
    prompt = PROMPTS[1] + " seven bright stars"

    async def go():
        async with AsyncClient(cluster.address("router")) as r, AsyncClient(colocated.address) as c:
            windowed = await r.generate(prompt, kv_window_end=-k, **GREEDY)
            return windowed, await c.generate(prompt, **GREEDY)

    windowed, expected = run(go())
    assert windowed.token_ids == expected.token_ids
    assert windowed.usage.route.kv_window_end == windowed.usage.prompt_tokens - k


def test_client_disconnect_frees_pages_on_both_nodes(cluster):
    async def go():
        async with AsyncClient(cluster.address("router")) as client:
            async for _ in client.responses(PROMPTS[2], max_tokens=200, ignore_eos=True):
                break
        return await wait_pools_full([cluster.address("prefill"), cluster.address("decode")])

    for report in run(go()):
        assert report.free_pages == report.total_pages, report


def test_page_pools_return_to_full_after_traffic(cluster, colocated):
    async def go():
        return await wait_pools_full([cluster.address("prefill"), cluster.address("decode"),
                                      colocated.address])

    reports = run(go())
    for report in reports:
        assert report.total_pages == 256
        assert report.free_pages == report.total_pages, report
        assert report.num_parked == 0

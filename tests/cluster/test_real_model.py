"""Router + prefill + decode as separate processes serving real weights
(SmolLM2-135M-Instruct): every chat prompt, the one of over 1,000 tokens included, is
prefilled on the prefill node and its KV written into the decode node through NIXL, or, on
a machine too loaded for a RemoteSend to finish within its lease, prefilled by the decode
node with the route saying why (correct behaviour, not a failure). Either way the greedy
answer equals transformers' token for token (tests/real_model_oracle.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from pdserve.client import AsyncClient
from tests.cluster.nodes import (SKIPPED_UNDER_LOAD, WORKER_FLAGS, Cluster, load, run,
                                 wait_pools_full)
from tests.real_model_oracle import (EOS, MAX_NEW, chat_prompts, chat_texts, greedy_reference,
                                     prompt_logprobs)


@pytest.fixture(scope="module")
def real_cluster(real_model, tmp_path_factory):
    nodes = Cluster(tmp_path_factory.mktemp("real-cluster-logs"), real_model)
    common = ["--model", real_model, "--host", "127.0.0.1"]
    try:
        for role in ("prefill", "decode"):  # start both, then wait: their start-ups overlap
            nodes.start(role, [role, *common, *WORKER_FLAGS], wait=False)
        nodes.wait("prefill", "decode")
        # 0: every prompt whose KV window the decode node lacks goes through RemoteSend.
        nodes.start("router", ["router", *common, "--min-remote-prefill-tokens", "0",
                               "--prefill", nodes.address("prefill"),
                               "--decode", nodes.address("decode")])
        yield nodes
    finally:
        nodes.stop()


def kv_bytes_per_token(model_dir: str) -> int:
    """K and V of one token in every layer, fp32 (the workers' default dtype)."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * c["head_dim"] * 4


def test_remote_prefill_greedy_equals_transformers_and_pools_refill(real_cluster, real_model):
    expected = greedy_reference(real_model)  # before the requests: both use the 2 cores
    prompts, texts = chat_prompts(real_model), chat_texts(real_model)
    prefill, decode = real_cluster.address("prefill"), real_cluster.address("decode")

    async def go():
        before = await load(prefill)
        async with AsyncClient(real_cluster.address("router")) as client:
            outs = await asyncio.gather(*(
                client.generate(text, temperature=0.0, max_tokens=MAX_NEW) for text in texts))
        return before, outs, await load(prefill)

    before, outs, after = run(go(), timeout_s=300)
    for prompt, want, out in zip(prompts, expected, outs):
        assert out.usage.prompt_tokens == len(prompt)
        assert out.token_ids == list(want), f"prompt of {len(prompt)} tokens: {out.text!r}"
        assert out.finish_reason == ("stop" if want[-1] == EOS else "length")
        route = out.usage.route
        assert route.decode_endpoint == decode, route
        if route.remote_send_skipped:
            assert route.skip_reason in SKIPPED_UNDER_LOAD, route
            continue
        assert route.prefill_endpoint == prefill, route
        assert route.kv_window_end == len(prompt) - 1  # all but the last prompt token
        assert route.kv_window_begin == route.prefix_matched_length
        if len(prompt) > 1000:
            assert route.kv_window_end - route.kv_window_begin > 1000  # KV moved
    assert max(len(p) for p in prompts) > 1000

    sent = [o.usage.route for o in outs if not o.usage.route.remote_send_skipped]
    sent_bytes = sum(r.kv_window_end - r.kv_window_begin for r in sent) * \
        kv_bytes_per_token(real_model)
    sends = after.remote_sends_total - before.remote_sends_total
    # A send whose lease ended first may still have finished on the prefill node, unused.
    assert len(sent) <= sends <= len(prompts)
    if sends == len(sent):
        assert after.kv_bytes_sent_total - before.kv_bytes_sent_total == sent_bytes
    else:
        assert after.kv_bytes_sent_total - before.kv_bytes_sent_total > sent_bytes

    for report in run(wait_pools_full([prefill, decode])):
        assert report.free_pages == report.total_pages, report
        assert report.num_parked == report.num_quarantined == report.num_running == 0, report


def test_the_long_prompt_is_scored_as_transformers_scores_it(real_cluster, real_model):
    prompt = chat_prompts(real_model)[-1]  # over 1,000 tokens: scored in chunks
    want = prompt_logprobs(real_model, prompt)

    async def go():
        async with AsyncClient(real_cluster.address("router")) as client:
            return await client.generate(list(prompt), temperature=0.0, max_tokens=1, prompt_logprobs=0)

    out = run(go(), timeout_s=300)
    got = out.prompt_logprobs
    assert [e.token_id for e in got] == list(prompt[1:])
    worst = max(abs(e.logprob - w) for e, w in zip(got, want))
    assert worst < 5e-4, worst
    assert out.usage.route.skip_reason == "prompt_logprobs" and out.usage.cached_prompt_tokens == 0
    for report in run(wait_pools_full([real_cluster.address("decode")])):
        assert report.free_pages == report.total_pages, report

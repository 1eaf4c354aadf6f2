"""Models of the newer families through a real cluster (router, prefill and decode
processes): a multimodal Gemma 3 checkpoint and a multimodal Llama 4 one (NoPE layers,
experts), whose language models the prefill and decode nodes load alone and whose routers
read their text configs, and a Phi-3 with LongRoPE served past its original 32 positions,
serve greedy tokens equal to transformers' (past Gemma 3's sliding window), each prompt's KV
window prefilled remotely and sent to the decode node, every pool full again afterwards.

The prompts, one after another: 40 tokens; 27, which LongRoPE's decode node computes again
once it grows past 32; and those 27 and 6 more, long, whose KV window (32 tokens) the
prefill node rotates by the long factors for the whole prompt, and whose cached beginning
(the 27's, short) neither node may reuse."""

from __future__ import annotations

import random

import pytest

from pdserve.client import AsyncClient
from tests.cluster.nodes import Cluster, run, wait_pools_full
from tests.cluster.test_tensor_parallel import transformers_greedy
from tests.engine.test_architectures import gemma3_multimodal_checkpoint

NEW = 8


def llama4_multimodal_checkpoint(path):
    from pdserve.engine.families import config_of
    from tests.engine.test_multimodal import save_multimodal

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8, vision_output_dim=32, projector_input_dim=32, projector_output_dim=64)
    return save_multimodal(path, "Llama4", config_of("llama4", 512), vision, image_token_index=5)


def longrope_checkpoint(path):
    """The phi3 family's: Phi-3.5's kind, LongRoPE past its original 32 positions."""
    from pdserve.engine.checkpoint import write_checkpoint

    return write_checkpoint(path, family="phi3")


@pytest.mark.parametrize("build", [gemma3_multimodal_checkpoint, llama4_multimodal_checkpoint, longrope_checkpoint])
def test_a_newer_family_prefilled_remotely_decodes_as_transformers(tmp_path, build):
    model = str(build(tmp_path / "model"))  # Gemma 3: 8-token windows on its first layer
    rng = random.Random(5)
    first = [rng.randrange(6, 512) for _ in range(33)]
    prompts = [[rng.randrange(6, 512) for _ in range(40)], first[:27], first]
    nodes = Cluster(tmp_path, model)
    common = ["--model", model, "--host", "127.0.0.1", "--page-size", "8", "--num-pages", "64"]
    try:
        nodes.start("p", ["prefill", *common], wait=False)
        nodes.start("d", ["decode", *common], wait=False)
        nodes.wait("p", "d")
        nodes.start("r", ["router", "--model", model, "--host", "127.0.0.1", "--min-remote-prefill-tokens", "0",
                          "--prefill", nodes.address("p"), "--decode", nodes.address("d")])

        async def ask():
            async with AsyncClient(nodes.address("r")) as client:
                return [await client.generate(p, max_tokens=NEW, temperature=0.0, ignore_eos=True) for p in prompts]

        outs = run(ask())
        for report in run(wait_pools_full([nodes.address("p"), nodes.address("d")])):
            assert report.free_pages == report.total_pages and report.num_running == 0, report
    finally:
        nodes.stop()
    assert [o.choices[0].token_ids for o in outs] == transformers_greedy(model, prompts, NEW)
    for out in outs:
        route = out.usage.route
        assert route.prefill_endpoint and route.kv_window_end > route.kv_window_begin, route

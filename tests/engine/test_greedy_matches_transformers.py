"""Greedy decoding through the engine equals transformers' `generate` token for token, for
every model family, whatever the batching, paging, chunking, caching or preemption."""

from __future__ import annotations

import pytest

from pdserve.engine import SamplingParams
from pdserve.engine.checkpoint import FAMILIES

MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
LENGTHS = [1, 7, 16, 23, 40]
EOS = 2


def check(llm, hf_greedy, family, prompts, params=GREEDY):
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(family, prompt, params.max_tokens), f"prompt of {len(prompt)} tokens"
        # Transformers stops at EOS (id 2) too; otherwise max_tokens ends it.
        assert out.finish_reason == ("stop" if out.token_ids[-1] == EOS else "length")
    return outs


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_mixed_length_batch_matches_transformers(family, page_size, make_engine, hf_greedy, prompts_of_lengths):
    llm = make_engine(family, llm=True, page_size=page_size, num_pages=1024 // page_size)
    check(llm, hf_greedy, family, prompts_of_lengths(LENGTHS, seed=1))


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_cache_hits_match_transformers(family, make_engine, hf_greedy, prompts_of_lengths):
    llm = make_engine(family, llm=True, page_size=4, num_pages=128)
    base = prompts_of_lengths([30], seed=2)[0]
    first = check(llm, hf_greedy, family, [base])[0]
    assert first.num_cached_tokens == 0
    extended = [base + [7, 8, 9], base[:21], base]
    outs = check(llm, hf_greedy, family, extended)
    assert [o.num_cached_tokens for o in outs] == [28, 20, 28]


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_with_small_budget_matches_transformers(family, make_engine, hf_greedy, prompts_of_lengths):
    llm = make_engine(family, llm=True, page_size=5, num_pages=200, max_num_batched_tokens=7)
    check(llm, hf_greedy, family, prompts_of_lengths(LENGTHS, seed=3))


@pytest.mark.parametrize("family", FAMILIES)
def test_preemption_in_tiny_pool_matches_transformers(family, make_engine, hf_greedy, prompts_of_lengths):
    # Each prompt needs 6-7 pages by the end; 6 prompts cannot all fit in 16 pages.
    llm = make_engine(family, llm=True, page_size=4, num_pages=16, max_num_batched_tokens=64)
    check(llm, hf_greedy, family, prompts_of_lengths([14, 15, 13, 16, 12, 15], seed=4))
    assert llm.engine.scheduler.num_preemptions > 0


def test_sharded_checkpoint_loads_and_matches(tmp_path, hf_greedy, prompts_of_lengths):
    from pdserve.engine import LLM
    from pdserve.engine.checkpoint import write_checkpoint

    d = write_checkpoint(tmp_path / "sharded", family="qwen2", seed=0, max_shard_size="100KB")
    assert (d / "model.safetensors.index.json").exists()
    llm = LLM(str(d), page_size=8, num_pages=64)
    check(llm, hf_greedy, "qwen2", prompts_of_lengths([9, 20], seed=5))
    assert llm.engine.num_free_pages() == llm.engine.num_total_pages()


def test_batched_output_equals_one_at_a_time(make_engine, prompts_of_lengths):
    """Batching must not change any sequence's tokens (no cross-talk between rows)."""
    llm = make_engine("qwen3", llm=True, page_size=3, num_pages=400)
    prompts = prompts_of_lengths([3, 11, 29, 2, 17, 8], seed=6)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    together = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert together == alone


def test_rows_not_sampled_stop_at_the_last_layers_kv(make_engine, hf_greedy, prompts_of_lengths):
    """Past the last layer's K/V write only the rows that are sampled are computed: the
    chunks before a prompt's last compute no row there, its last chunk one, a decode one."""
    llm = make_engine("llama", llm=True, page_size=5, num_pages=200, max_num_batched_tokens=16)
    layers = llm.engine.model.layers
    rows = {"first": [], "last": []}

    def counting(name, linear):
        def call(x):
            rows[name].append(x.shape[0])
            return linear(x)
        return call

    layers[0].gate_up = counting("first", layers[0].gate_up)
    layers[-1].gate_up = counting("last", layers[-1].gate_up)
    (out,) = check(llm, hf_greedy, "llama", prompts_of_lengths([40], seed=5))
    generated = len(out.token_ids)
    assert generated > 1
    assert rows["first"] == [16, 16, 8] + [1] * (generated - 1)
    assert rows["last"] == [1] * generated


@pytest.mark.parametrize("family", FAMILIES)
def test_a_layer_major_pool_matches_transformers(family, make_engine, hf_greedy, prompts_of_lengths):
    """`--kv-layout layer-major` orders the pool's memory by layer (engine/kv_pool.py):
    every kernel, the prefix cache and preemption read and write it by its strides."""
    from pdserve.kvtransfer.layout import LAYER_MAJOR, KVLayout

    llm = make_engine(family, llm=True, page_size=4, num_pages=24, max_num_batched_tokens=16,
                      kv_layout="layer-major")
    assert KVLayout.from_tensor(llm.engine.kv_cache, 4).kind == LAYER_MAJOR
    base = prompts_of_lengths([30], seed=7)[0]
    check(llm, hf_greedy, family, [base])
    outs = check(llm, hf_greedy, family, [base + [7, 8, 9], base[:21], *prompts_of_lengths([14, 15, 13], seed=8)])
    assert outs[0].num_cached_tokens == 28 and llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.num_free_pages() == llm.engine.num_total_pages()

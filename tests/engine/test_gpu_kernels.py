"""On a real GPU (skipped without one): the Triton kernels compiled for it agree with the
reference, and the engine's GPU step path (pinned inputs, CUDA graphs of decode steps)
generates transformers' greedy tokens. `pdserve bench gpu` runs these (`-k "cuda or gpu"`)."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.attention import triton_ops
from tests.engine.paged_cases import CASES, make_case, reference_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_paged_attention_matches_reference(name, dtype):
    query_lens, seq_lens, h, hkv, d, ps = CASES[name]
    args = make_case(0, query_lens, seq_lens, h, hkv, d, ps, dtype=dtype, device="cuda")
    scale = 1.0 / math.sqrt(d)
    out = triton_ops.paged_attention(*args, ps, scale, max_query_len=max(query_lens))
    assert not out.isnan().any()
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), reference_attention(*args, ps, scale).float(), atol=tol, rtol=tol)
    # without max_query_len it is read from the tensors: the same result
    torch.testing.assert_close(triton_ops.paged_attention(*args, ps, scale), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [None, 1, 3, 16])
def test_cuda_decode_split_over_the_context_matches_reference(splits, dtype):
    args = make_case(4, [1, 1, 1], [5, 300, 1500], 32, 8, 64, 16, dtype=dtype, device="cuda")
    out = triton_ops.paged_attention(*args, 16, 0.125, max_query_len=1, num_splits=splits)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), reference_attention(*args, 16, 0.125).float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("query_lens, splits", [([1, 1, 1], 1), ([1, 1, 1], 3), ([1, 1, 9], None)])
def test_cuda_attention_sinks_count_once_whatever_the_splits(query_lens, splits):
    """GPT-OSS's sinks, compiled: decodes split over their context, and beside a prefill chunk."""
    args = make_case(5, query_lens, [5, 700, 40], 16, 4, 64, 16, device="cuda")
    sinks = torch.linspace(-2.0, 5.0, 16, device="cuda")
    out = triton_ops.paged_attention(*args, 16, 0.125, max_query_len=max(query_lens), num_splits=splits, window=32,
                                     sinks=sinks)
    want = reference_attention(*args, 16, 0.125, window=32, sinks=sinks)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-5, rtol=2e-5)


def test_cuda_store_kv_skips_padding_slots():
    kv = torch.zeros(4, 2, 2, 3, 2, 8, device="cuda")
    k_cache, v_cache = kv[:, 1, 0], kv[:, 1, 1]
    k = torch.randn(3, 2, 8, device="cuda")
    v = torch.randn(3, 2, 8, device="cuda")
    triton_ops.store_kv(k_cache, v_cache, k, v, torch.tensor([4, -1, 11], device="cuda"))
    assert torch.equal(kv[1, 1, 0, 1], k[0]) and torch.equal(kv[3, 1, 1, 2], v[2])
    assert kv.count_nonzero() == 2 * 2 * 2 * 8


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_cuda_graphs_generate_transformers_greedy_tokens(checkpoint_dirs, family):
    from transformers import AutoModelForCausalLM

    from pdserve.engine import LLM, SamplingParams

    model = checkpoint_dirs(family)
    prompts = [[5, 6, 7, 8, 9] * 4, [10, 11, 12], [13, 40, 7] * 9, [3] * 50]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to("cuda").eval()
    want = []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                          min_new_tokens=8, pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for graphs in (True, False):
        llm = LLM(model, device="cuda", page_size=3, max_num_batched_tokens=16, max_num_seqs=6, cuda_graphs=graphs)
        assert (llm.engine.runner.graphs is not None) == graphs
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        assert got == want, (graphs, got, want)
        assert llm.engine.num_free_pages() == llm.engine.num_total_pages()


def test_cuda_sampling_keeps_seeded_rows_repeatable(checkpoint_dirs):
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(checkpoint_dirs("llama"), device="cuda", max_num_seqs=4)
    params = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, top_k=20, seed=7, logprobs=2)
    a, b = llm.generate([[5, 6, 7], [9, 10]], params), llm.generate([[5, 6, 7]], params)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
    assert len(a[0].outputs[0].logprobs) == 6

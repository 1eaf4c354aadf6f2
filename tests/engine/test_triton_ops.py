"""The Triton kernels, run by Triton's CPU interpreter, agree with a plain torch reference
and with the torch path: decode, prefill over a cached prefix, GQA of several ratios, odd
head dims and page sizes (1 and non-powers of two), on strided page views of a page-major
pool like the engine's."""

from __future__ import annotations

import os

# The interpreter must be chosen before the kernels are jitted (on their first call).
os.environ["TRITON_INTERPRET"] = "1"

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402, F401  (a dependency: these tests run its interpreter)

from engine.attention import torch_ops, triton_ops  # noqa: E402


def reference_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, page_size, scale):
    """Gather each sequence's context through its block table, then causal softmax
    attention of its queries, which are the last positions of the context."""
    out = torch.empty_like(q, dtype=torch.float32)
    group = q.shape[1] // k_cache.shape[2]
    for b in range(len(seq_lens)):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        ctx = int(seq_lens[b])
        pos = torch.arange(ctx)
        pages = block_tables[b].long()[pos // page_size]
        k = k_cache[pages, pos % page_size].float().repeat_interleave(group, dim=1)  # [ctx, H, D]
        v = v_cache[pages, pos % page_size].float().repeat_interleave(group, dim=1)
        qs = q[start:end].float()  # [n, H, D]
        scores = torch.einsum("nhd,chd->hnc", qs, k) * scale
        q_pos = torch.arange(ctx - (end - start), ctx)
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[start:end] = torch.einsum("hnc,chd->nhd", scores.softmax(-1), v)
    return out


def make_case(seed, query_lens, seq_lens, num_heads, num_kv_heads, head_dim, page_size, dtype=torch.float32):
    """Layer 1 of a page-major pool [pages, 3 layers, K/V, page_size, Hkv, D] whose pages
    are shuffled, whose unused slots and other layers hold NaN (so any read outside a
    context, or off by a stride, shows up), with every context's K/V written by the kernel
    under test."""
    g = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per_seq) + 3
    order = torch.randperm(num_pages, generator=g).tolist()
    max_pages = max(pages_per_seq) + 1  # one spare column, padded with page 0
    block_tables = torch.zeros(len(seq_lens), max_pages, dtype=torch.int32)
    pool = torch.full((num_pages, 3, 2, page_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    used = 0
    all_slots, all_k, all_v = [], [], []
    for b, (n_pages, ctx) in enumerate(zip(pages_per_seq, seq_lens)):
        pages = order[used : used + n_pages]
        used += n_pages
        block_tables[b, :n_pages] = torch.tensor(pages, dtype=torch.int32)
        pos = torch.arange(ctx)
        all_slots.append(torch.tensor(pages)[pos // page_size] * page_size + pos % page_size)
        all_k.append(torch.randn(ctx, num_kv_heads, head_dim, generator=g).to(dtype))
        all_v.append(torch.randn(ctx, num_kv_heads, head_dim, generator=g).to(dtype))
    triton_ops.store_kv(k_cache, v_cache, torch.cat(all_k), torch.cat(all_v), torch.cat(all_slots))
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=g).to(dtype)
    query_start_loc = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32)
    return q, k_cache, v_cache, block_tables, query_start_loc, torch.tensor(seq_lens, dtype=torch.int32)


CASES = {
    # name: (query_lens, seq_lens, heads, kv_heads, head_dim, page_size)
    "decode_gqa2_page16": ([1, 1, 1], [1, 17, 40], 4, 2, 64, 16),
    "prefill_over_prefix_gqa3_dim40_page3": ([5, 7], [5, 20], 6, 2, 40, 3),
    "mixed_mha_dim24_page1": ([1, 4, 1], [9, 4, 3], 2, 2, 24, 1),
    "dim256_gqa8_page5": ([1, 3], [12, 7], 8, 1, 256, 5),
    "long_prefill_two_query_blocks": ([70, 1], [75, 30], 2, 2, 32, 16),
}


@pytest.mark.parametrize("name", list(CASES))
def test_paged_attention_matches_reference_and_torch_path(name):
    query_lens, seq_lens, h, hkv, d, ps = CASES[name]
    args = make_case(0, query_lens, seq_lens, h, hkv, d, ps)
    scale = 1.0 / math.sqrt(d)
    out = triton_ops.paged_attention(*args, ps, scale)
    assert not out.isnan().any()
    torch.testing.assert_close(out, reference_attention(*args, ps, scale), atol=2e-5, rtol=2e-5)
    # The torch path reads whole pages and masks scores, so it needs finite unused slots.
    q, k_cache, v_cache, *rest = args
    finite = (q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0), *rest)
    torch.testing.assert_close(out, torch_ops.paged_attention(*finite, ps, scale), atol=2e-5, rtol=2e-5)


def test_paged_attention_in_half_precision():
    args = make_case(1, [1, 6], [20, 6], 4, 2, 64, 16, dtype=torch.float16)
    out = triton_ops.paged_attention(*args, 16, 0.125)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), reference_attention(*args, 16, 0.125), atol=2e-3, rtol=2e-3)


def test_store_kv_writes_exactly_the_given_slots():
    g = torch.Generator().manual_seed(2)
    k_cache = torch.zeros(5, 4, 2, 24)  # [pages, page_size, kv heads, head dim]
    v_cache = torch.zeros(5, 4, 2, 24)
    k, v = torch.randn(4, 2, 24, generator=g), torch.randn(4, 2, 24, generator=g)
    slots = torch.tensor([7, 3, -1, 19])  # -1: a padding token, written nowhere
    triton_ops.store_kv(k_cache, v_cache, k, v, slots)
    expected_k, expected_v = torch.zeros(20, 2, 24), torch.zeros(20, 2, 24)
    expected_k[[7, 3, 19]] = k[[0, 1, 3]]
    expected_v[[7, 3, 19]] = v[[0, 1, 3]]
    assert torch.equal(k_cache.view(20, 2, 24), expected_k) and torch.equal(v_cache.view(20, 2, 24), expected_v)


@pytest.mark.parametrize("ops", [torch_ops, triton_ops], ids=["torch", "triton"])
def test_store_kv_into_a_layer_view_of_the_page_major_cache(ops):
    kv_cache = torch.zeros(5, 3, 2, 4, 2, 8)  # [pages, layers, K/V, page_size, kv heads, head dim]
    k, v = torch.ones(3, 2, 8), torch.full((3, 2, 8), 2.0)
    ops.store_kv(kv_cache[:, 1, 0], kv_cache[:, 1, 1], k, v, torch.tensor([6, 7, 8]))  # pages 1 and 2
    assert torch.equal(kv_cache[1, 1, 0, 2:4], k[:2]) and torch.equal(kv_cache[2, 1, 0, 0], k[2])
    assert torch.equal(kv_cache[1, 1, 1, 2:4], v[:2]) and torch.equal(kv_cache[2, 1, 1, 0], v[2])
    assert kv_cache.sum() == k.sum() + v.sum()


def test_importing_triton_ops_does_not_import_triton():
    import subprocess
    import sys

    code = "import sys, engine.attention.triton_ops; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_engine_on_the_triton_backend_generates_the_torch_backends_tokens(tmp_path):
    from engine import LLM, SamplingParams
    from engine.checkpoint import write_checkpoint

    model = write_checkpoint(tmp_path / "qwen3", family="qwen3")  # head_dim 24, GQA 2
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9] * 4, [10, 11, 12], [13, 40, 7] * 9]
    torch_path = LLM(model, page_size=3).generate(prompts, params)
    # A small token budget chunks the prefills, so attention runs over cached prefixes.
    triton_path = LLM(model, page_size=3, attention_backend="triton", max_num_batched_tokens=16).generate(prompts, params)
    assert [o.token_ids for o in triton_path] == [o.token_ids for o in torch_path]

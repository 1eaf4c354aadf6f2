"""Shared by the attention kernels' tests: a page-major pool with each sequence's pages
scattered over it, the check that a kernel's plan attends as the torch gather + SDPA
path does, and the Triton kernels' cases and reference (run by the interpreter on the CPU
and compiled on a GPU)."""

from __future__ import annotations

import torch

from pdserve.engine.attention import cpu_ops, triton_ops


def scattered_pool(num_kv_heads, head_dim, page_size, seq_lens, dtype, g: torch.Generator):
    """(k_cache, v_cache, page_lists): one layer's strided views of a random
    [pages, 2 layers, K/V, page_size, Hkv, D] pool (layer 1's, what attention reads), and
    for each sequence enough pages for its length, taken in random order."""
    num_pages = sum(-(-n // page_size) for n in seq_lens) + 3
    pool = torch.randn(num_pages, 2, 2, page_size, num_kv_heads, head_dim, generator=g).to(dtype)
    order = torch.randperm(num_pages, generator=g).tolist()  # pages scattered over the pool
    page_lists, used = [], 0
    for n in seq_lens:
        need = -(-n // page_size)
        page_lists.append(order[used : used + need])
        used += need
    return pool[:, 1, 0], pool[:, 1, 1], page_lists


def kernel_and_torch_plans(q, k_cache, v_cache, query_lens, seq_lens, page_lists, page_size, dtype, window=0,
                           softcap=0.0, sinks=None):
    """Attend with the plan that uses the C kernels and with the one that does not (under
    a sliding `window`, if > 0, scores capped at `softcap`, if > 0, with attention `sinks`,
    if given); assert the outputs agree (fp32 1e-5, bf16 2e-2) and return both plans."""
    with_kernel = cpu_ops.plan_attention(query_lens, seq_lens, page_lists, page_size, "cpu", dtype, window, softcap)
    without = cpu_ops.plan_attention(query_lens, seq_lens, page_lists, page_size, "cpu", None, window, softcap)
    scale = q.shape[-1] ** -0.5
    got = cpu_ops.attend(q, k_cache, v_cache, with_kernel, scale, sinks)
    want = cpu_ops.attend(q, k_cache, v_cache, without, scale, sinks)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    return with_kernel, without


def reference_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, page_size, scale,
                        window=0, softcap=0.0, sinks=None):
    """Gather each sequence's context through its block table, then causal softmax
    attention of its queries, which are the last positions of the context (each seeing
    its last `window` only, if > 0; scores capped at `softcap`, if > 0; `sinks` [H], if
    given, a last score column of head h's softmax, dropped after it, as transformers'
    eager GPT-OSS attention does)."""
    device = q.device
    q, k_cache, v_cache, block_tables, query_start_loc, seq_lens = (
        t.cpu() for t in (q, k_cache, v_cache, block_tables, query_start_loc, seq_lens))
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
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(ctx - (end - start), ctx)
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        if window:
            scores = scores.masked_fill(pos[None, None, :] <= q_pos[None, :, None] - window, float("-inf"))
        if sinks is not None:
            column = sinks.float().cpu().view(-1, 1, 1).expand(-1, end - start, 1)
            probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[start:end] = torch.einsum("hnc,chd->nhd", probs, v)
    return out.to(device)


def make_case(seed, query_lens, seq_lens, num_heads, num_kv_heads, head_dim, page_size, dtype=torch.float32,
              device="cpu"):
    """Layer 1 of a page-major pool [pages, 3 layers, K/V, page_size, Hkv, D] whose pages
    are shuffled, whose unused slots and other layers hold NaN (so any read outside a
    context, or off by a stride, shows up), with every context's K/V written by the Triton
    KV store (on `device`)."""
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
    pool = pool.to(device)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    triton_ops.store_kv(k_cache, v_cache, *(torch.cat(x).to(device) for x in (all_k, all_v, all_slots)))
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=g).to(dtype)
    query_start_loc = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32)
    return tuple(t.to(device) for t in (q, k_cache, v_cache, block_tables, query_start_loc,
                                        torch.tensor(seq_lens, dtype=torch.int32)))


CASES = {
    # name: (query_lens, seq_lens, heads, kv_heads, head_dim, page_size)
    "decode_gqa2_page16": ([1, 1, 1], [1, 17, 40], 4, 2, 64, 16),
    "prefill_over_prefix_gqa3_dim40_page3": ([5, 7], [5, 20], 6, 2, 40, 3),
    "mixed_mha_dim24_page1": ([1, 4, 1], [9, 4, 3], 2, 2, 24, 1),
    "dim256_gqa8_page5": ([1, 3], [12, 7], 8, 1, 256, 5),
    "long_prefill_two_query_blocks": ([70, 1], [75, 30], 2, 2, 32, 16),
}

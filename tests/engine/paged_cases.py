"""Shared by the C attention kernels' tests: a page-major pool with each sequence's pages
scattered over it, and the check that a kernel's plan attends as the torch gather + SDPA
path does."""

from __future__ import annotations

import torch

from engine.attention import torch_ops


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


def kernel_and_torch_plans(q, k_cache, v_cache, query_lens, seq_lens, page_lists, page_size, dtype):
    """Attend with the plan that uses the C kernels and with the one that does not; assert
    the outputs agree (fp32 1e-5, bf16 2e-2) and return both plans."""
    with_kernel = torch_ops.plan_attention(query_lens, seq_lens, page_lists, page_size, "cpu", dtype)
    without = torch_ops.plan_attention(query_lens, seq_lens, page_lists, page_size, "cpu", None)
    scale = q.shape[-1] ** -0.5
    got = torch_ops.attend(q, k_cache, v_cache, with_kernel, scale)
    want = torch_ops.attend(q, k_cache, v_cache, without, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    return with_kernel, without

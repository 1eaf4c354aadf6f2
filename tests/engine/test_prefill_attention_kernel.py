"""The C prefill-attention kernel gives the same attention as the torch gather + SDPA path:
fresh prompts (causal), chunks after a cached prefix, chunks beside decodes, on strided page
views of a page-major pool like the engine's, in both the vector shape (head_dim 64, pages
of 16: AVX-512, and AVX2, built without AVX-512 where the CPU has it) and the generic loops."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.attention import cpu_ops
from pdserve.engine.attention.prefill_attention import kernel_for
from tests.engine.paged_cases import kernel_and_torch_plans, scattered_pool


def test_the_kernel_builds_here():
    # As for the decode kernel: these machines have a compiler, so None is a build failure.
    assert kernel_for(torch.float32, torch.device("cpu")) is not None
    assert kernel_for(torch.bfloat16, torch.device("cpu")) is not None


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,page_size,query_lens,seq_lens",
    [
        (9, 3, 64, 16, [256], [256]),  # SmolLM2's shape: a fresh prompt
        (9, 3, 64, 16, [200, 37], [456, 37]),  # a chunk after a 256-token prefix, a short prompt
        (9, 3, 64, 16, [1, 1, 70, 5], [40, 300, 83, 5]),  # decodes, then chunks ending mid-page
        (16, 4, 64, 16, [33, 1], [33, 17]),  # a decode after a chunk: its own kernel run
        (4, 4, 32, 1, [5, 9], [5, 12]),  # no GQA, pages of one slot
        (6, 2, 48, 5, [23, 60], [23, 61]),
        (8, 1, 128, 16, [40], [97]),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_gather_and_sdpa(num_heads, num_kv_heads, head_dim, page_size, query_lens, seq_lens, dtype,
                                        kernel_isa):
    g = torch.Generator().manual_seed(1)
    k_cache, v_cache, page_lists = scattered_pool(num_kv_heads, head_dim, page_size, seq_lens, dtype, g)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=g).to(dtype)
    with_kernel, without = kernel_and_torch_plans(q, k_cache, v_cache, query_lens, seq_lens, page_lists,
                                                  page_size, dtype)
    assert with_kernel.prefills and all(s.kernel is not None for s in with_kernel.prefills)
    assert without.prefills and all(s.kernel is None for s in without.prefills)


def test_a_query_sees_no_later_position():
    # Changing the K/V of the last position changes only the last query's output.
    g = torch.Generator().manual_seed(2)
    k_cache, v_cache, page_lists = scattered_pool(3, 64, 16, [50], torch.float32, g)
    q = torch.randn(50, 9, 64, generator=g)
    plan = cpu_ops.plan_attention([50], [50], page_lists, 16, "cpu", torch.float32)
    before = cpu_ops.attend(q, k_cache, v_cache, plan, 0.125)
    last_page, row = page_lists[0][49 // 16], 49 % 16
    k_cache[last_page, row] += 3.0
    v_cache[last_page, row] -= 5.0
    after = cpu_ops.attend(q, k_cache, v_cache, plan, 0.125)
    torch.testing.assert_close(after[:49], before[:49], atol=0, rtol=0)
    assert not torch.allclose(after[49], before[49])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scores_that_climb_and_spike_along_the_context(dtype, kernel_isa):
    # The AVX-512 and AVX2 paths move a query's reference max only when a score passes it by more
    # than a margin, then rescales its sums: keys whose scale climbs with position, and a
    # spike mid-context, pass it again and again, on pages after the first.
    g = torch.Generator().manual_seed(3)
    seq_lens, query_lens = [300, 181], [300, 81]
    k_cache, v_cache, page_lists = scattered_pool(3, 64, 16, seq_lens, dtype, g)
    for pages, n in zip(page_lists, seq_lens):
        for pos in range(n):
            page, row = pages[pos // 16], pos % 16
            climb = 1.0 + pos / 50.0
            k_cache[page, row] = (k_cache[page, row].float() * climb).to(dtype)
        k_cache[pages[150 // 16], 150 % 16] = (k_cache[pages[150 // 16], 150 % 16].float() * 10).to(dtype)
    q = torch.randn(sum(query_lens), 9, 64, generator=g).to(dtype)
    kernel_and_torch_plans(q, k_cache, v_cache, query_lens, seq_lens, page_lists, 16, dtype)

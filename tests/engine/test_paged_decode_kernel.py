"""The C paged-decode kernel gives the same attention as the torch gather + SDPA path,
reading strided page views of a page-major pool like the engine's, as built for this CPU
and, on an AVX-512 CPU, built without AVX-512 (its AVX2 paths)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.attention import cpu_ops
from pdserve.engine.attention.paged_decode import kernel_for
from tests.engine.paged_cases import kernel_and_torch_plans, reference_attention, scattered_pool


def test_the_kernel_builds_here():
    # The engine falls back to gather + SDPA without a C compiler; these machines have one,
    # so a missing kernel here is a build failure, not an environment to skip over.
    assert kernel_for(torch.float32, torch.device("cpu")) is not None
    assert kernel_for(torch.bfloat16, torch.device("cpu")) is not None


def _case(num_heads, num_kv_heads, head_dim, page_size, lens, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache, page_lists = scattered_pool(num_kv_heads, head_dim, page_size, lens, dtype, g)
    q = torch.randn(len(lens), num_heads, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, page_lists


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,page_size,lens",
    [
        (16, 4, 64, 16, [384, 17, 1, 200, 16]),
        (4, 4, 32, 1, [5, 9, 1]),
        (6, 2, 48, 5, [23, 7, 60]),
        (8, 1, 128, 16, [33]),
        # head_dim 64 with pages of other sizes: the bf16 scores' 16-row groups, split or partial
        (9, 3, 64, 32, [70, 3, 33]),
        (9, 3, 64, 5, [23, 7]),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_gather_and_sdpa(num_heads, num_kv_heads, head_dim, page_size, lens, dtype, kernel_isa):
    q, k_cache, v_cache, page_lists = _case(num_heads, num_kv_heads, head_dim, page_size, lens, dtype)
    with_kernel, without = kernel_and_torch_plans(q, k_cache, v_cache, [1] * len(lens), lens, page_lists,
                                                  page_size, dtype)
    assert with_kernel.decode_runs and not with_kernel.decode_groups
    assert without.decode_groups and not without.decode_runs


@pytest.mark.parametrize("page_size, window", [(16, 40), (5, 7), (1, 3), (16, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sliding_window_skips_the_pages_before_it_as_the_masked_path_does(page_size, window, dtype, kernel_isa):
    lens = [384, 17, 1, 41, window, window + 1]  # past the window, within it, at its edge
    q, k_cache, v_cache, page_lists = _case(8, 2, 64, page_size, lens, dtype, seed=3)
    kernel_and_torch_plans(q, k_cache, v_cache, [1] * len(lens), lens, page_lists, page_size, dtype, window)
    whole, _ = kernel_and_torch_plans(q, k_cache, v_cache, [1] * len(lens), lens, page_lists, page_size, dtype)
    windowed = cpu_ops.attend(q, k_cache, v_cache, cpu_ops.plan_attention(
        [1] * len(lens), lens, page_lists, page_size, "cpu", dtype, window), 0.125)
    got_whole = cpu_ops.attend(q, k_cache, v_cache, whole, 0.125)
    differs = [not torch.allclose(windowed[b], got_whole[b]) for b in range(len(lens))]
    assert differs == [n > window for n in lens]  # the window masks exactly the longer contexts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_capped_scores_match_the_plain_torch_path_and_change_the_output(dtype, kernel_isa):
    lens = [70, 3, 33]
    q, k_cache, v_cache, page_lists = _case(8, 2, 64, 16, lens, dtype, seed=4)
    q = q * 8  # scores well past the cap
    capped, _ = kernel_and_torch_plans(q, k_cache, v_cache, [1] * 3, lens, page_lists, 16, dtype, softcap=2.0)
    kernel_and_torch_plans(q, k_cache, v_cache, [1] * 3, lens, page_lists, 16, dtype, window=40, softcap=2.0)
    assert not torch.allclose(cpu_ops.attend(q, k_cache, v_cache, capped, 0.125),
                              cpu_ops.attend(q, k_cache, v_cache, cpu_ops.plan_attention(
                                  [1] * 3, lens, page_lists, 16, "cpu", dtype), 0.125))


def _reference(q, k_cache, v_cache, query_lens, lens, page_lists, page_size, window, softcap, sinks):
    """paged_cases' plain-torch reference over the same pages as the plans."""
    tables = torch.tensor([pl + [0] * (max(map(len, page_lists)) - len(pl)) for pl in page_lists])
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    return reference_attention(q, k_cache, v_cache, tables, starts, torch.tensor(lens), page_size, 0.125,
                               window, softcap, sinks)


@pytest.mark.parametrize("window, softcap", [(0, 0.0), (7, 0.0), (40, 2.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sinks_match_the_reference_in_decodes_and_chunks_over_a_context(window, softcap, dtype, kernel_isa):
    # Decodes (the C kernel's runs, or the torch path's groups) around prefill chunks over a
    # cached prefix (the C prefill kernel's, which takes no sink, or the torch path's); GQA 4,
    # a sink per query head, each different, so one read through the wrong head shows.
    query_lens, lens = [1, 1, 5, 1, 20], [70, 3, 33, 40, 20]
    g = torch.Generator().manual_seed(5)
    k_cache, v_cache, page_lists = scattered_pool(2, 64, 16, lens, dtype, g)
    q = torch.randn(sum(query_lens), 8, 64, generator=g).to(dtype)
    sinks = torch.linspace(-2.0, 5.0, 8)  # below and above the scores' log-sum-exps
    with_kernel, without = kernel_and_torch_plans(q, k_cache, v_cache, query_lens, lens, page_lists, 16, dtype,
                                                  window, softcap, sinks)
    assert with_kernel.decode_runs and without.decode_groups and not without.decode_runs
    assert any(s.kernel is not None for s in with_kernel.prefills) == (not window and not softcap)
    want = _reference(q, k_cache, v_cache, query_lens, lens, page_lists, 16, window, softcap, sinks)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for plan in (with_kernel, without):
        got = cpu_ops.attend(q, k_cache, v_cache, plan, 0.125, sinks)
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
        assert not torch.allclose(got, cpu_ops.attend(q, k_cache, v_cache, plan, 0.125))  # the sinks matter
    with pytest.raises(ValueError, match="one per query head"):  # a sink per KV head is a mistake
        cpu_ops.attend(q, k_cache, v_cache, with_kernel, 0.125, sinks[:2])


def test_kernel_refuses_views_whose_pages_are_not_packed():
    from pdserve.engine.attention.paged_decode import paged_decode

    # [pages, page_size, kv heads, head dim] cut from a wider head dim: rows not packed
    k_cache = torch.randn(4, 4, 2, 16)[..., :8]
    kernel = kernel_for(torch.float32, torch.device("cpu"))
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="packed pages"):
        paged_decode(kernel, torch.randn(1, 2, 8), k_cache, k_cache, tables, lens, 4, 0.3)


def test_loading_the_kernel_keeps_subnormal_floats_in_the_process():
    # A library built with -ffast-math turns on flush-to-zero for the whole process when it
    # loads, silently changing every other float computation (torch's and Python's).
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from engine.attention.paged_decode import kernel_for\n"
        "assert kernel_for(torch.float32, torch.device('cpu')) is not None\n"
        "tiny = 5e-324\n"
        "assert tiny * 1.0 > 0.0, 'subnormal flushed to zero'\n"
        "assert torch.tensor(1e-40, dtype=torch.float32).mul(1.0).item() > 0.0\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)

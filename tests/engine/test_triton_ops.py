"""The Triton kernels, run by Triton's CPU interpreter, agree with a plain torch reference
and with the torch path: decode, prefill over a cached prefix, GQA of several ratios, odd
head dims and page sizes (1 and non-powers of two), on strided page views of a page-major
pool like the engine's."""

from __future__ import annotations

import os

import pytest
import torch

# Triton picks the interpreter when it is imported, for the whole process: on a host with
# CUDA, these interpreter tests would turn the GPU tests of the same session into
# interpreted ones. tests/engine/test_gpu_kernels.py runs the kernels compiled there.
if torch.cuda.is_available():
    pytest.skip("Triton interpreter tests; with CUDA, test_gpu_kernels.py runs the kernels compiled",
                allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported, and so before anything jits

import math  # noqa: E402
import triton  # noqa: E402, F401  (a dependency: these tests run its interpreter)

from pdserve.engine.attention import cpu_ops, triton_ops  # noqa: E402
from tests.engine.paged_cases import CASES, make_case, reference_attention  # noqa: E402


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
    torch.testing.assert_close(out, cpu_ops.paged_attention(*finite, ps, scale), atol=2e-5, rtol=2e-5)


# (query_lens, seq_lens, heads, kv_heads, head_dim, page_size, splits): splits of several
# tiles and of none (a context shorter than the splits' tiles), odd pages, GQA 1 to 8.
SPLIT_CASES = {
    "two_splits_of_tiles": ([1, 1, 1], [1, 17, 300], 4, 2, 64, 16, 2),
    "five_splits_page3": ([1, 1], [130, 5], 6, 2, 40, 3, 5),
    "sixteen_splits_dim256": ([1], [700], 8, 1, 256, 5, 16),
    "mha_page1": ([1, 1], [1, 64], 2, 2, 24, 1, 3),
}


@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_decode_split_over_the_context_matches_reference(name):
    query_lens, seq_lens, h, hkv, d, ps, splits = SPLIT_CASES[name]
    args = make_case(3, query_lens, seq_lens, h, hkv, d, ps)
    scale = 1.0 / math.sqrt(d)
    out = triton_ops.paged_attention(*args, ps, scale, max_query_len=1, num_splits=splits)
    assert not out.isnan().any()
    torch.testing.assert_close(out, reference_attention(*args, ps, scale), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out, triton_ops.paged_attention(*args, ps, scale, max_query_len=1, num_splits=1),
                               atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("window, softcap", [(7, 0.0), (0, 0.5), (20, 0.5)])
@pytest.mark.parametrize("splits", [1, 3])
def test_a_sliding_window_and_capped_scores_match_the_reference(window, softcap, splits):
    # Decodes past the window and inside it (split or not), then prefill chunks over a cached
    # prefix, whose first rows see keys the last rows no longer do.
    scale = 0.5  # scores past the cap
    args = make_case(7, [1, 1, 1], [70, 5, 21], 4, 2, 32, 4)
    out = triton_ops.paged_attention(*args, 4, scale, max_query_len=1, num_splits=splits, window=window,
                                     softcap=softcap)
    torch.testing.assert_close(out, reference_attention(*args, 4, scale, window, softcap), atol=2e-5, rtol=2e-5)
    args = make_case(8, [40, 3], [90, 3], 4, 2, 32, 5)
    out = triton_ops.paged_attention(*args, 5, scale, window=window, softcap=softcap)
    torch.testing.assert_close(out, reference_attention(*args, 5, scale, window, softcap), atol=2e-5, rtol=2e-5)
    assert not torch.allclose(out, reference_attention(*args, 5, scale))  # the window or cap matters here


@pytest.mark.parametrize("window, softcap", [(0, 0.0), (7, 0.0), (20, 0.5)])
@pytest.mark.parametrize("splits", [1, 3])
def test_sinks_match_the_reference_once_per_query_head_split_or_not(window, softcap, splits):
    # A sink per query head, each different (GQA 3: a read through the KV head's index shows),
    # below and above the scores' log-sum-exps. Split decodes must count each sink once, not
    # once a split; an empty context gives zeros still. Then prefill chunks over a prefix.
    scale, sinks = 0.5, torch.linspace(-1.0, 4.0, 6)
    args = make_case(9, [1, 1, 1, 1], [70, 5, 21, 0], 6, 2, 32, 4)
    out = triton_ops.paged_attention(*args, 4, scale, max_query_len=1, num_splits=splits, window=window,
                                     softcap=softcap, sinks=sinks)
    want = reference_attention(*args, 4, scale, window, softcap, sinks)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    assert not torch.allclose(out[:3], reference_attention(*args, 4, scale, window, softcap)[:3])  # they matter
    args = make_case(10, [40, 3, 1], [90, 3, 17], 6, 2, 32, 5)
    out = triton_ops.paged_attention(*args, 5, scale, window=window, softcap=softcap, sinks=sinks)
    torch.testing.assert_close(out, reference_attention(*args, 5, scale, window, softcap, sinks), atol=2e-5, rtol=2e-5)


def test_sinks_in_half_precision_and_as_the_torch_path_has_them():
    args = make_case(11, [1, 6], [20, 26], 4, 2, 64, 16, dtype=torch.float16)
    sinks = torch.tensor([0.5, 3.0, -1.0, 2.0])
    out = triton_ops.paged_attention(*args, 16, 0.125, sinks=sinks)
    torch.testing.assert_close(out.float(), reference_attention(*args, 16, 0.125, sinks=sinks), atol=2e-3, rtol=2e-3)
    q, k_cache, v_cache, *rest = make_case(11, [1, 6], [20, 26], 4, 2, 64, 16)
    finite = (q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0), *rest)  # the torch path reads whole pages
    torch.testing.assert_close(triton_ops.paged_attention(*finite, 16, 0.125, sinks=sinks),
                               cpu_ops.paged_attention(*finite, 16, 0.125, sinks=sinks), atol=2e-5, rtol=2e-5)


def test_an_empty_context_gives_zeros_split_or_not():
    q, k_cache, v_cache, tables, starts, lens = make_case(5, [1, 1], [9, 9], 4, 2, 16, 4)
    lens = torch.tensor([9, 0], dtype=lens.dtype)
    for splits in (1, 3):
        out = triton_ops.paged_attention(q, k_cache, v_cache, tables, starts, lens, 4, 0.25, max_query_len=1,
                                         num_splits=splits)
        assert torch.equal(out[1], torch.zeros_like(out[1])) and not out[0].isnan().any(), splits


def test_splits_are_for_decodes_and_bounded():
    args = make_case(0, [3, 1], [8, 4], 4, 2, 16, 4)
    with pytest.raises(ValueError, match="num_splits=2 needs decodes alone"):
        triton_ops.paged_attention(*args, 4, 0.25, num_splits=2)
    with pytest.raises(ValueError, match=r"num_splits must be in \[1, 16\], got 17"):
        triton_ops.paged_attention(*make_case(0, [1], [8], 4, 2, 16, 4), 4, 0.25, num_splits=17)
    with pytest.raises(ValueError, match=r"launch \(8, 64, 4\): rows and tile must be powers of two >= 16"):
        triton_ops.paged_attention(*make_case(0, [1], [8], 4, 2, 16, 4), 4, 0.25, launch=(8, 64, 4))


def test_decode_splits_fill_the_gpu_from_the_batch_shape(monkeypatch):
    assert triton_ops.decode_splits(1, 8, torch.device("cpu")) == 1
    monkeypatch.setattr(triton_ops, "_sm_count", lambda index: 132)  # an H200
    cuda = torch.device("cuda", 0)
    assert [triton_ops.decode_splits(b, 8, cuda) for b in (1, 2, 16, 32, 64, 256)] == [16, 16, 2, 1, 1, 1]
    assert triton_ops.decode_splits(8, 3, cuda) == 11


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


@pytest.mark.parametrize("ops", [cpu_ops, triton_ops], ids=["cpu", "triton"])
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
    from pdserve.engine import LLM, SamplingParams
    from pdserve.engine.checkpoint import write_checkpoint

    model = write_checkpoint(tmp_path / "qwen3", family="qwen3")  # head_dim 24, GQA 2
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9] * 4, [10, 11, 12], [13, 40, 7] * 9]
    torch_path = LLM(model, page_size=3).generate(prompts, params)
    # A small token budget chunks the prefills, so attention runs over cached prefixes.
    triton_path = LLM(model, page_size=3, attention_backend="triton", max_num_batched_tokens=16).generate(prompts, params)
    assert [o.token_ids for o in triton_path] == [o.token_ids for o in torch_path]

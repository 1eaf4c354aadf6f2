"""`engine.native`: the KV cache's memory, marked for huge pages, is still plain zeros."""

from __future__ import annotations

import torch

from engine.native import zeros_on_huge_pages


def test_the_kv_cache_allocation_is_zeroed_and_shaped():
    for shape in [(3, 5), (2, 1 << 20)]:  # smaller than one huge page, and several of them
        t = zeros_on_huge_pages(shape, torch.bfloat16)
        assert t.shape == shape and t.dtype == torch.bfloat16 and t.is_contiguous() and not t.any()

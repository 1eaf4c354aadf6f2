"""`engine.native`: the KV cache's memory is plain zeros that cost nothing until written."""

from __future__ import annotations

import torch

from engine.native import lazy_zeros


def test_the_kv_cache_allocation_is_zeroed_and_shaped():
    for shape in [(3, 5), (2, 1 << 20)]:  # less than a 4 KiB page, and many of them
        t = lazy_zeros(shape, torch.bfloat16)
        assert t.shape == shape and t.dtype == torch.bfloat16 and t.is_contiguous() and not t.any()


def test_a_large_kv_cache_costs_no_memory_until_written():
    def resident_kib() -> int:
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    before = resident_kib()
    t = lazy_zeros((256, 1 << 20), torch.float32)  # 1 GiB
    assert resident_kib() - before < 64 * 1024  # not touched: far below its size
    t[3].fill_(1.0)
    assert float(t[3].sum()) == 1 << 20 and not t[4].any()


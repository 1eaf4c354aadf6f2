"""How many KV pages a pool gets (engine/memory.py): the flags that size it, and on a GPU a
share of the device's total memory, so that two workers sharing one GPU get the same pools
whichever allocates first (the device here is a stand-in: this runs without a GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.engine import memory

MIB = 1 << 20


def config(device="cpu", fraction=0.25, num_pages=0, mb=0):
    return SimpleNamespace(device=device, kv_cache_memory_fraction=fraction, num_pages=num_pages,
                           kv_cache_memory_bytes=mb * MIB)


@pytest.fixture
def gpu(monkeypatch):
    """A stand-in 80 GiB device whose free memory the test sets."""
    device = SimpleNamespace(free=80 * 1024 * MIB)
    monkeypatch.setattr(memory, "free_memory_bytes", lambda d: device.free)
    monkeypatch.setattr(memory, "device_total_bytes", lambda d: 80 * 1024 * MIB)
    return device


def test_the_flags_that_size_a_pool_win_in_order():
    assert memory.kv_cache_pages(config(num_pages=7, mb=64), MIB) == (7, "--num-pages")
    assert memory.kv_cache_pages(config(mb=64), MIB) == (64, "--kv-cache-mb 64")


def test_two_workers_on_one_gpu_get_their_shares_of_it_whichever_sizes_first(gpu):
    prefill, decode = config("cuda", 0.25 / 3), config("cuda:0", 0.5 / 3)
    gpu.free = 70 * 1024 * MIB  # both measure after their own weights, before either pool
    first = memory.kv_cache_pages(prefill, MIB)[0], memory.kv_cache_pages(decode, MIB)[0]
    gpu.free = 70 * 1024 * MIB - first[0] * MIB  # decode sizes after prefill's pool exists
    assert memory.kv_cache_pages(decode, MIB)[0] == first[1] == int(80 * 1024 * 0.5 / 3)
    pages, how = memory.kv_cache_pages(prefill, MIB)
    assert pages == first[0] and how == f"--kv-cache-memory-fraction {0.25 / 3} of 81920 MiB ({gpu.free >> 20} MiB free)"


def test_a_gpu_pool_leaves_a_tenth_of_the_free_memory_for_activations_and_graphs(gpu):
    gpu.free = 10 * 1024 * MIB
    assert memory.kv_cache_pages(config("cuda", 0.9), MIB)[0] == int(0.9 * 10 * 1024)

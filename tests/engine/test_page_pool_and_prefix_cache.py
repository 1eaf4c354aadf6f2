"""Page accounting, reference counts and LRU eviction of cached pages."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.page_pool import OutOfPages, PagePool
from pdserve.engine.prefix_cache import PrefixCache, extend_page_keys


def keys_of(tokens, page_size=2):
    keys = []
    extend_page_keys(keys, tokens, page_size, len(tokens) // page_size)
    return keys


def test_allocation_is_all_or_nothing():
    pool = PagePool(4, 2)
    pool.allocate(3)
    with pytest.raises(OutOfPages):
        pool.allocate(2)
    assert pool.num_free_pages() == 1


def test_cached_pages_are_shared_reference_counted_and_count_as_free_when_idle():
    pool = PagePool(4, 2)
    cache = PrefixCache(pool)
    pages = pool.allocate(2)
    keys = keys_of([1, 2, 3, 4])
    for page, key in zip(pages, keys):
        cache.publish(page, key)
    assert cache.match(keys) == pages  # a second holder
    assert pool.ref_count(pages[0]) == 2
    pool.release_all(pages)
    pool.release_all(pages)
    assert pool.num_free_pages() == 4
    assert cache.match(keys) == pages  # still cached while idle
    pool.release_all(pages)


def test_match_stops_at_first_difference_and_keys_chain_the_prefix():
    pool = PagePool(8, 2)
    cache = PrefixCache(pool)
    pages = pool.allocate(3)
    for page, key in zip(pages, keys_of([1, 2, 3, 4, 5, 6])):
        cache.publish(page, key)
    assert cache.match(keys_of([1, 2, 9, 9, 5, 6])) == pages[:1]
    # Same tokens at a different offset are a different page: keys chain the prefix.
    assert cache.match(keys_of([5, 6])) == []
    pool.release(pages[0])
    pool.release_all(pages)


def test_eviction_takes_free_pages_first_then_least_recently_used():
    pool = PagePool(3, 1)
    cache = PrefixCache(pool)
    a, b = pool.allocate(2)
    cache.publish(a, keys_of([10], 1)[0])
    cache.publish(b, keys_of([20], 1)[0])
    pool.release(a)
    pool.release(b)  # idle order: a (older), b
    (c,) = pool.allocate(1)
    assert c not in (a, b)  # the never-used page goes first
    (d,) = pool.allocate(1)
    assert d == a  # then the least recently used idle page, which is forgotten
    assert cache.match(keys_of([10], 1)) == []
    assert cache.match(keys_of([20], 1)) == [b]
    pool.release_all([b, c, d])
    assert pool.num_free_pages() == 3


def test_pages_come_lowest_first_and_ascending_so_a_window_is_few_runs():
    """KV moves in one descriptor per run of consecutive pages: released tail first by
    two sequences, the pool's pages still come back as one run."""
    pool = PagePool(16, 4)
    first, second = pool.allocate(4), pool.allocate(4)
    assert (first, second) == ([0, 1, 2, 3], [4, 5, 6, 7])
    pool.release_all(second)  # tail first: 7, 6, 5, 4
    pool.release_all(first)
    assert pool.allocate(6) == [0, 1, 2, 3, 4, 5]
    cache = PrefixCache(pool)
    rest = pool.allocate(10)  # 6, 7 and the never-used 8..15
    assert rest == list(range(6, 16))
    for page, key in zip(rest, keys_of(list(range(40)), 4)):
        cache.publish(page, key)
    pool.release_all(rest)  # idle, least recently used: 15, 14, ..., 6
    assert pool.allocate(3) == [13, 14, 15]  # evicted tail first, handed out ascending


def test_disabled_cache_never_matches():
    pool = PagePool(2, 1)
    cache = PrefixCache(pool, enabled=False)
    (a,) = pool.allocate(1)
    cache.publish(a, 1)
    assert cache.match([1]) == []
    pool.release(a)
    assert pool.num_free_pages() == 2


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5)), max_size=60))
def test_random_use_keeps_exact_accounting(ops):
    pool = PagePool(6, 1)
    cache = PrefixCache(pool)
    held: list[int] = []
    for op, arg in ops:
        if op == 0:
            try:
                held += pool.allocate(1 + arg % 2)
            except OutOfPages:
                pass
        elif op == 1 and held:
            pool.release(held.pop(arg % len(held)))
        elif op == 2:
            if held:
                cache.publish(held[arg % len(held)], arg)
            held += cache.match([arg])
        referenced = {p for p in range(6) if pool.ref_count(p) > 0}
        assert pool.num_free_pages() == 6 - len(referenced)
        assert sorted(p for p in held if True) == sorted(p for p in range(6) for _ in range(pool.ref_count(p)))
    for p in held:
        pool.release(p)
    assert pool.num_free_pages() == 6

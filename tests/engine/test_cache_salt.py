"""A request's cache salt seeds its page keys: equal prompts under different salts share no
cached page, equal salts share as before, and the empty salt keeps the unsalted keys."""

from __future__ import annotations

from pdserve.engine import SamplingParams
from pdserve.engine.page_pool import PagePool
from pdserve.engine.prefix_cache import PrefixCache, extend_page_keys

GREEDY = SamplingParams(max_tokens=2, temperature=0.0)
TOKENS = list(range(1, 13))


def keys_of(tokens, salt="", page_size=4):
    keys = []
    extend_page_keys(keys, tokens, page_size, len(tokens) // page_size, salt)
    return keys


def test_the_empty_salt_gives_the_unsalted_keys():
    unsalted = []
    extend_page_keys(unsalted, TOKENS, 4, 3)
    assert keys_of(TOKENS, "") == unsalted
    # ... which chain from no parent, as they always did.
    assert unsalted[0] == hash((None, tuple(TOKENS[:4])))


def test_every_key_of_a_salted_chain_differs_from_other_salts():
    chains = [keys_of(TOKENS, s) for s in ("", "a", "b", "tenant\x00a")]
    keys = [k for chain in chains for k in chain]
    assert len(set(keys)) == len(keys)
    assert keys_of(TOKENS, "a") == keys_of(TOKENS, "a")


def test_a_cache_matches_only_the_salt_that_published():
    pool = PagePool(8, 4)
    cache = PrefixCache(pool)
    pages = pool.allocate(3)
    for page, key in zip(pages, keys_of(TOKENS, "victim")):
        cache.publish(page, key)
    assert cache.match(keys_of(TOKENS, "attacker")) == []
    assert cache.match(keys_of(TOKENS, "")) == []
    assert cache.match(keys_of(TOKENS, "victim")) == pages
    pool.release_all(pages)
    pool.release_all(pages)


def finished(engine, request_id):
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out
    raise AssertionError(f"{request_id} never finished")


def test_engine_counts_cached_tokens_only_within_the_salt(make_engine, prompts_of_lengths):
    engine = make_engine(page_size=4, num_pages=64)
    prompt = prompts_of_lengths([21], seed=5)[0]
    engine.add_request("victim", prompt, GREEDY, cache_salt="t1")
    assert finished(engine, "victim").num_cached_tokens == 0
    for request_id, salt, cached in [("other", "t2", 0), ("open", "", 0), ("same", "t1", 20)]:
        engine.add_request(request_id, prompt, GREEDY, cache_salt=salt)
        assert finished(engine, request_id).num_cached_tokens == cached, salt
    # A decode node's reservation matches its prefix cache under the request's salt too.
    other = engine.prepare_receive("r2", prompt, GREEDY, kv_window_end=17, cache_salt="t3")
    same = engine.prepare_receive("r1", prompt, GREEDY, kv_window_end=17, cache_salt="t1")
    assert (other.prefix_matched_length, same.prefix_matched_length) == (0, 16)
    assert engine.abort("r1") and engine.abort("r2")


def test_a_salt_that_is_no_string_is_refused_by_name(make_engine):
    engine = make_engine(page_size=4, num_pages=16)
    try:
        engine.add_request("x", [5, 6, 7], GREEDY, cache_salt=7)
    except ValueError as err:
        assert "cache_salt" in str(err) and "7" in str(err)
    else:
        raise AssertionError("a non-string salt was accepted")

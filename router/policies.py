"""Dispatch policies: which endpoint of a pool serves the next request.

A policy is any object with `pick(endpoints, prompt_token_ids, cache_salt="") -> Endpoint`
(the salt: whose cached prefixes the request may use, router/cache_salt.py); `endpoints`
is never empty (the registry only asks when some endpoint is usable). Prefill and decode
pools each get their own (`--prefill-policy`, `--decode-policy`):

- `round_robin`: each endpoint in turn.
- `least_loaded`: the fewest requests queued or running (`Endpoint.queue`: this router's
  own plus what the node last reported beyond them, so several routers balance each
  other), ties broken by the most free KV pages, then in turn.
- `prefix_aware`: the smallest estimated work, `uncached + load_tokens * queue`, where
  `uncached` is the prompt's tokens not covered by the longest prefix the router believes
  the node caches (router/prefix_index.py) and every queued request counts as
  `load_tokens` tokens (default 128). So a node holding a long prefix wins unless it is
  busier by more than that prefix is worth. When the pool is badly imbalanced (the busiest
  node has more than `balance_abs` requests over the idlest and more than `balance_rel`
  times as many), it picks as `least_loaded` does, as SGLang's cache-aware policy does.
  Ties go in turn.
A request with a `prompt_cache_key` (OpenAI's) goes to the endpoint its key names in
either pool, whatever the policy (`keyed_endpoint`): the one with the highest rendezvous
hash of the key (with the request's cache salt) and its address, so every router sends a
key to the same nodes without sharing any state, and a node's leaving moves only its own
keys. A key's node that the pool's balance rule above finds badly overloaded is passed over:
the policy picks instead.
The router never holds state that routing correctness depends on: losing the load reports
or the prefix index only makes choices less good.
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Protocol, Sequence

BALANCE_ABS, BALANCE_REL = 8, 1.5  # "badly imbalanced": more requests than the idlest's by both


class Policy(Protocol):
    def pick(self, endpoints: Sequence, prompt_token_ids: Sequence[int],
             cache_salt: str = ""): ...


class RoundRobin:
    """Each endpoint in turn, skipping none: the simplest fair spread."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, endpoints: Sequence, prompt_token_ids: Sequence[int], cache_salt: str = ""):
        return endpoints[next(self._counter) % len(endpoints)]


def _first_in_turn(candidates: Sequence, counter) -> object:
    """One of equally good candidates, rotating so ties spread."""
    return candidates[next(counter) % len(candidates)]


class LeastLoaded:
    """Fewest queued requests, then most free pages, then in turn."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, endpoints: Sequence, prompt_token_ids: Sequence[int], cache_salt: str = ""):
        key = lambda e: (e.queue, -e.free_pages)  # noqa: E731
        best = min(key(e) for e in endpoints)
        return _first_in_turn([e for e in endpoints if key(e) == best], self._counter)


class PrefixAware:
    """Longest cached prefix weighed against load (see the module docstring)."""

    def __init__(self, load_tokens: int = 128, balance_abs: int = BALANCE_ABS,
                 balance_rel: float = BALANCE_REL) -> None:
        self.load_tokens = load_tokens
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self._least_loaded = LeastLoaded()
        self._counter = itertools.count()

    def pick(self, endpoints: Sequence, prompt_token_ids: Sequence[int], cache_salt: str = ""):
        queues = [e.queue for e in endpoints]
        if _overloaded(max(queues), min(queues), self.balance_abs, self.balance_rel):
            return self._least_loaded.pick(endpoints, prompt_token_ids)
        n = len(prompt_token_ids)
        cost = {id(e): n - min(e.prefixes.match(prompt_token_ids, cache_salt), n)
                + self.load_tokens * e.queue for e in endpoints}
        best = min(cost.values())
        return _first_in_turn([e for e in endpoints if cost[id(e)] == best], self._counter)


def _overloaded(queue: int, idlest: int, balance_abs: int = BALANCE_ABS, balance_rel: float = BALANCE_REL) -> bool:
    return queue - idlest > balance_abs and queue > balance_rel * idlest


def keyed_endpoint(endpoints: Sequence, key: str, salt: str = ""):
    """The endpoint `key` names (rendezvous hashing over the addresses), or None when the
    pool's balance rule finds it badly overloaded."""
    def weight(e) -> bytes:  # hashlib, not hash(): the same in every router process
        return hashlib.blake2b(f"{salt}\0{key}\0{e.address}".encode(), digest_size=8).digest()

    chosen = max(endpoints, key=weight)
    return None if _overloaded(chosen.queue, min(e.queue for e in endpoints)) else chosen


POLICIES = {"round_robin": RoundRobin, "least_loaded": LeastLoaded, "prefix_aware": PrefixAware}


def make_policy(name: str, **options) -> Policy:
    """A policy by name; `options` (e.g. load_tokens) go to the policies that take them."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}") from None
    return cls(**options) if cls is PrefixAware else cls()

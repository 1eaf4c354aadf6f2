"""The router's guess of which prompt prefixes a node holds in its prefix cache.

Nodes cache KV by full pages, keyed by the chain of the tokens before it; the router mirrors
that with one hash per `block` tokens (the node's page size), chained so a block's hash
stands for the whole prefix up to its end. Each prompt the router sends to a node is
recorded there (what it will have cached afterwards); `match` counts the leading blocks of a
prompt the node is believed to hold. A request's cache salt (router/cache_salt.py) seeds the
chain as it seeds the nodes' page keys: a prompt matches only what was recorded under its salt.

It is only a guess, like SGLang's cache-aware tree or llm-d's prefix scorer: the node may
have evicted pages, or another router may have filled them. Nothing depends on it for
correctness (the nodes match their own caches); losing it (a router restart, a second
router) only makes routing less cache-friendly until it fills again. It is bounded: at
most `capacity` blocks, the least recently used dropped first (`capacity` follows the node's
page count when its load reports tell it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence


class PrefixIndex:
    def __init__(self, block: int = 16, capacity: int = 65536) -> None:
        if block <= 0:
            raise ValueError(f"block must be positive, got {block}")
        self.block = block
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def _hashes(self, tokens: Sequence[int], salt: str) -> Iterator[int]:
        h = hash(("cache_salt", salt)) if salt else 0
        b = self.block
        for start in range(0, len(tokens) - b + 1, b):
            h = hash((h, tuple(tokens[start:start + b])))
            yield h

    def match(self, tokens: Sequence[int], salt: str = "") -> int:
        """Tokens of the longest prefix of `tokens` recorded under `salt` (a multiple of
        `block`)."""
        n = 0
        for h in self._hashes(tokens, salt):
            if h not in self._blocks:
                break
            n += 1
        return n * self.block

    def insert(self, tokens: Sequence[int], salt: str = "") -> None:
        """Record that the node now holds every full block of `tokens`, under `salt`."""
        for h in self._hashes(tokens, salt):
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()

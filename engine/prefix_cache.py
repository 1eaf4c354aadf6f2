"""The prefix cache: full KV pages found again by the tokens that produced them.

A full page's key chains the key of the page before it with the page's own token ids, so
equal keys mean equal whole prefixes, and a match is always a run of pages from position 0.
A request's cache salt seeds the chain, so only requests with the same salt share pages.
Invariants:
- Only full pages whose KV is completely computed are published; a page's content never
  changes while it is published (sequences only write positions past their cached prefix).
- One key maps to at most one page. A page computed twice (two sequences with the same
  prefix in flight at once) stays private to its sequence and is simply freed later.
- Reference counts and LRU eviction live in `PagePool`; when the pool evicts an idle page
  it calls `_forget` so no key points at reused memory.
"""

from __future__ import annotations

from .page_pool import PagePool


def extend_page_keys(keys: list[int], token_ids: list[int], page_size: int, num_pages: int,
                     salt: str = "") -> None:
    """Extend `keys` (chained keys of the first full pages of `token_ids`) to `num_pages`.
    A non-empty `salt` (the request's cache salt) seeds the chain: equal tokens under other
    salts never share a key, so a request can neither hit nor probe another salt's pages.
    The empty salt gives the unsalted keys."""
    seed = ("cache_salt", salt) if salt else None
    for p in range(len(keys), num_pages):
        parent = keys[-1] if keys else seed
        keys.append(hash((parent, tuple(token_ids[p * page_size : (p + 1) * page_size]))))


class PrefixCache:
    def __init__(self, pool: PagePool, enabled: bool = True):
        self.pool = pool
        self.enabled = enabled
        self._page_of: dict[int, int] = {}
        self._key_of: dict[int, int] = {}
        pool.on_evict = self._forget

    def match(self, keys: list[int]) -> list[int]:
        """The cached pages of the longest prefix of `keys` (chained page keys, see
        `extend_page_keys`); each returned page gets one reference (the caller owns it)."""
        if not self.enabled:
            return []
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            self.pool.retain(page)
        return pages

    def publish(self, page: int, key: int) -> None:
        """Make a full, computed, referenced page findable under `key`."""
        if not self.enabled or key in self._page_of or page in self._key_of:
            return
        self._page_of[key] = page
        self._key_of[page] = key
        self.pool.mark_cached(page, True)

    def is_published(self, page: int) -> bool:
        return page in self._key_of

    def _forget(self, page: int) -> None:
        key = self._key_of.pop(page, None)
        if key is not None:
            del self._page_of[key]

    def clear(self) -> None:
        """Drop every published page (idle ones become free)."""
        for page in list(self._key_of):
            self._forget(page)
            self.pool.mark_cached(page, False)

"""The page pool: which KV pages exist, who references them, which are free.

A page is `page_size` consecutive slots of the KV cache. Invariants:
- Every page is in exactly one of three states: referenced (`ref > 0`), free (unreferenced,
  content worthless), or idle (unreferenced, but its content is published in the prefix
  cache and can be reused until it is evicted).
- Idle pages count as free: `num_free_pages()` is free + idle, so an idle engine reports
  `num_free_pages() == num_total_pages()`.
- `allocate` takes free pages first, lowest-numbered first, and evicts idle pages least
  recently used first, telling the owner of their content (`on_evict`) so nothing keeps
  pointing at them. The pages of one call come back in ascending order.
- Why lowest first and ascending: KV moves between nodes in one descriptor per run of
  consecutive pages (per layer in a layer-major pool), so a window's pages should be few
  runs; sequences release tail first, so pages handed out in release order would not be.
- Allocation is all or nothing: `OutOfPages` leaves the pool unchanged.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Callable


class OutOfPages(RuntimeError):
    """Raised when a request asks for more pages than are free (free + evictable)."""


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._ref = [0] * num_pages
        self._free: list[int] = list(range(num_pages))  # a heap
        self._idle: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._cached = [False] * num_pages  # content published in the prefix cache
        self.on_evict: Callable[[int], None] = lambda page: None

    def num_free_pages(self) -> int:
        return len(self._free) + len(self._idle)

    def num_total_pages(self) -> int:
        return self.num_pages

    def ref_count(self, page: int) -> int:
        return self._ref[page]

    def allocate(self, n: int) -> list[int]:
        """`n` pages, each with one reference; raises `OutOfPages` if not available."""
        if n > self.num_free_pages():
            raise OutOfPages(f"need {n} pages, {self.num_free_pages()} free of {self.num_pages}")
        pages = []
        for _ in range(n):
            if self._free:
                page = heapq.heappop(self._free)
            else:
                page, _ = self._idle.popitem(last=False)
                self._cached[page] = False
                self.on_evict(page)
            self._ref[page] = 1
            pages.append(page)
        pages.sort()  # evicted pages come tail first
        return pages

    def retain(self, page: int) -> None:
        """One more reference to `page` (an idle cached page becomes referenced again)."""
        if self._ref[page] == 0:
            if page not in self._idle:
                raise AssertionError(f"retain of free page {page}")
            del self._idle[page]
        self._ref[page] += 1

    def release(self, page: int) -> None:
        """Drop one reference; an unreferenced page becomes idle if cached, else free."""
        if self._ref[page] <= 0:
            raise AssertionError(f"release of unreferenced page {page}")
        self._ref[page] -= 1
        if self._ref[page] == 0:
            if self._cached[page]:
                self._idle[page] = None
            else:
                heapq.heappush(self._free, page)

    def release_all(self, pages: list[int]) -> None:
        # Last page first: a sequence's tail is the least likely to be shared again, so it
        # should be evicted before its head.
        for page in reversed(pages):
            self.release(page)

    def mark_cached(self, page: int, cached: bool) -> None:
        """The prefix cache published (True) or dropped (False) this page's content."""
        self._cached[page] = cached
        if not cached and self._ref[page] == 0 and page in self._idle:
            del self._idle[page]
            heapq.heappush(self._free, page)

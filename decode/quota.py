"""Each caller's bound on KV pages held in reservations not yet started
(`--max-parked-fraction-per-caller`), and the order in which that caller's reservations
wait for it.

- The bound: a caller (its TLS name, else its host) may hold at most the fraction of the
  pool in parked reservations. A caller that holds none may always reserve, even a window
  larger than its share: the pool's own line bounds it, and a lone request that fits the
  pool is never refused for the share alone.
- Pages of reservations that passed the bound but have no lease yet (they may still wait
  in the line for pages) count as held: the bound holds while they wait.
- The order: a caller's reservations over its bound wait, outside the line for pages (so
  no other caller waits behind them), in the order of the request's priority, then of
  arrival, as in the line for pages (decode/page_line.py): only the first of them tries
  the bound, so a later or smaller one never overtakes it. A newcomer whose priority is
  better than every waiting one's tries at once.
"""

from __future__ import annotations

import asyncio
import itertools

from pdserve.runtime.errors import NodeOverloaded


class CallerQuota:
    def __init__(self, fraction: float, num_pages: int) -> None:
        self.fraction = fraction
        self.limit = int(fraction * num_pages)
        self._waiting: dict[str, list[tuple[int, int]]] = {}  # caller -> (priority, arrival), in order
        self._arrivals = itertools.count()
        self._passing: dict[str, int] = {}  # caller -> pages past the bound, without a lease yet
        self._joined = asyncio.Event()  # a reservation began to wait

    def check(self, caller: str, held: int, pages: int) -> None:
        """NodeOverloaded if `caller`, which holds `held` parked pages, may not park `pages` more."""
        held += self._passing.get(caller, 0)
        if self.fraction < 1 and held and held + pages > self.limit:
            raise NodeOverloaded(
                f"caller {caller or 'in-process'!r} holds {held} KV pages in reservations not "
                f"yet started; {pages} more would pass its bound of {self.limit} "
                f"(max_parked_fraction_per_caller {self.fraction})")

    def passing(self, caller: str, pages: int) -> None:
        """`pages` passed `caller`'s bound: held until `passed` (its lease counts them then)."""
        self._passing[caller] = self._passing.get(caller, 0) + pages

    def passed(self, caller: str, pages: int) -> None:
        self._passing[caller] -= pages
        if not self._passing[caller]:
            del self._passing[caller]

    def may_try(self, caller: str, priority: int, turn: tuple[int, int] | None) -> bool:
        """Whether a reservation (waiting with `turn`, or new: None) tries the bound now."""
        waiting = self._waiting.get(caller)
        if not waiting:
            return True
        return waiting[0] == turn if turn is not None else priority < waiting[0][0]

    def join(self, caller: str, priority: int) -> tuple[int, int]:
        """A waiting turn, behind every one of its priority or a better one."""
        turn = (priority, next(self._arrivals))
        waiting = self._waiting.setdefault(caller, [])
        waiting.append(turn)
        waiting.sort()
        self._joined.set()
        return turn

    async def until_waiting(self, n: int) -> None:
        """Return once at least `n` reservations wait for their caller's bound (for
        observers, e.g. tests)."""
        while sum(map(len, self._waiting.values())) < n:
            self._joined.clear()
            await self._joined.wait()

    def leave(self, caller: str, turn: tuple[int, int]) -> None:
        waiting = self._waiting[caller]
        waiting.remove(turn)
        if not waiting:
            del self._waiting[caller]

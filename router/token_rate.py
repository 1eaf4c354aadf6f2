"""A token-rate limit per tenant: one token bucket each (`--tenant-token-rate`).

A request costs its prompt plus the tokens it may generate (max_tokens × n). A bucket holds
`burst_s` seconds of the rate and refills continuously. A request passes when the bucket
holds its cost, or a full burst for one larger than a burst (it may then go below zero:
such a request waits for a full bucket, never forever, and the debt slows the next ones,
so the average rate holds). Refused, the caller learns when it would pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class TokenRate:
    def __init__(self, rate: float, burst_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst = rate, rate * burst_s
        self.clock = clock
        self._level: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, when)

    def take(self, tenant: str, tokens: int) -> float | None:
        """None: `tokens` are spent from `tenant`'s bucket; else the seconds until the
        bucket would hold them (nothing spent)."""
        now = self.clock()
        level, when = self._level.get(tenant, (self.burst, now))
        level = min(self.burst, level + (now - when) * self.rate)
        need = min(tokens, self.burst)
        if level < need:
            self._level[tenant] = (level, now)
            return (need - level) / self.rate
        self._level[tenant] = (level - tokens, now)
        return None

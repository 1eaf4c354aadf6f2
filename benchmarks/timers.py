"""Time spent in wrapped calls, summed by kind of work (`pdserve bench step`, `bench host`)."""

from __future__ import annotations

import time
from collections import defaultdict


class Timers:
    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, kind: str, fn):
        seconds = self.seconds

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[kind] += time.perf_counter() - start

        return timed

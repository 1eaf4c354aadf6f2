"""A clock tests move by hand: stands in for the `time` module of one role module
(`monkeypatch.setattr(prefill.role, "time", clock)`), so a lease or deadline passes
because the test says so, not because the test waited."""

from __future__ import annotations

import time as _time


class FakeClock:
    """`time()`, `monotonic()` and `perf_counter()` as the real ones when built, plus
    whatever `advance` added since."""

    def __init__(self) -> None:
        self._offset = 0.0

    def advance(self, seconds: float) -> None:
        self._offset += seconds

    def time(self) -> float:
        return _time.time() + self._offset

    def monotonic(self) -> float:
        return _time.monotonic() + self._offset

    def perf_counter(self) -> float:
        return _time.perf_counter() + self._offset

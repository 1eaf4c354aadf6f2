"""`Poller`: a thread that calls `poll()` every `busy_s` while there is work, and every
`idle_s` once there has been none for `idle_after_s`.

Why: without NIXL's progress thread, UCX only progresses inside our calls, and the agent
polls to keep connection wire-up, incoming notifications and target-side work (TCP puts)
moving while nobody is transferring. At 10 ms those polls alone cost a node ~1.3% of a
core while it served nothing (by thread, over 10 s of an idle `pdserve up`, whose limit
is 5% for all four processes); at 100 ms once idle, a tenth of that.

Work is whatever calls `stay_active` (every transfer, notification or peer the agent
handles, and a node about to be written to, for as long as it waits), or a `poll()` that
returns True. Leaving idle wakes the thread at once: the first poll after idling is not
a whole idle interval late.
"""

from __future__ import annotations

import threading
import time
from typing import Callable


class Poller:
    def __init__(self, poll: Callable[[], bool], name: str, busy_s: float, idle_s: float, idle_after_s: float,
                 on_start: Callable[[], None] | None = None):
        """`on_start`: called first on the thread (to set thread-local state such as a CUDA device)."""
        if busy_s <= 0 or idle_s < busy_s:
            raise ValueError(f"poll intervals must be positive, the idle one ({idle_s}) no shorter than the "
                             f"busy one ({busy_s})")
        self._poll, self._on_start = poll, on_start
        self._busy_s, self._idle_s, self._idle_after_s = busy_s, idle_s, idle_after_s
        self._active_until = time.monotonic() + idle_after_s
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by close, and when work starts after idling
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def idle(self) -> bool:
        return time.monotonic() >= self._active_until

    def stay_active(self, seconds: float | None = None) -> None:
        """Poll every `busy_s` for the next `seconds` (default `idle_after_s`) at least."""
        until = time.monotonic() + (self._idle_after_s if seconds is None else seconds)
        if until > self._active_until:
            was_idle = self.idle
            self._active_until = until
            if was_idle:
                self._wake.set()

    def next_wait(self) -> float:
        """How long the thread waits before its next poll, unless woken."""
        return self._idle_s if self.idle else self._busy_s

    def _run(self) -> None:
        if self._on_start is not None:
            self._on_start()
        while not self._stop.is_set():
            self._wake.wait(self.next_wait())
            self._wake.clear()
            if self._stop.is_set():
                return
            if self._poll():
                self.stay_active()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)

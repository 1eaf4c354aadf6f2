"""What `bench serve` shows while a run goes on, on stderr: a tqdm bar on a terminal, plain
lines elsewhere (a log or CI keeps a line at each tenth of the run, not a bar redrawn with
carriage returns). Failed requests are counted as they come, so a run that is failing says
so before it ends."""

from __future__ import annotations

import sys
import time

LINES_PER_RUN = 10


class RunProgress:
    def __init__(self, total: int, desc: str, stream=None) -> None:
        self.total, self.desc = total, desc
        self.stream = sys.stderr if stream is None else stream
        self.done = self.failed = 0
        self.started = time.monotonic()
        self._next_line = 1  # the tenth of the run whose end prints the next plain line
        self.bar = None
        if self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="req", file=self.stream, leave=False)
        else:
            self._say(f"{desc}: {total} requests")

    def add(self, ok: bool) -> None:
        """One request ended (`ok`: completed)."""
        self.done += 1
        self.failed += not ok
        if self.bar is not None:
            if not ok:
                self.bar.set_postfix(failed=self.failed, refresh=False)
            self.bar.update(1)
        elif self.done * LINES_PER_RUN >= self._next_line * self.total:
            self._next_line = self.done * LINES_PER_RUN // self.total + 1
            self._say(f"{self.desc}: {self.done}/{self.total} done, {self.failed} failed, "
                      f"{time.monotonic() - self.started:.1f} s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def _say(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

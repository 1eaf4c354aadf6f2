"""Spawning pdserve nodes as real processes for end-to-end tests.

Each node is started with `--port 0` and reports the port it bound; every process is
killed at the end (SIGTERM, then SIGKILL), whatever the test did.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from pdserve.up import exit_with_parent

REPO = Path(__file__).resolve().parents[2]
LISTENING = re.compile(r"listening on \S+:(\d+)|router on \S+:(\d+)")
WORKER_FLAGS = ["--num-threads", "1", "--num-pages", "256", "--page-size", "8"]


def env() -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    return e


class Node:
    """One pdserve process. `wait=False` returns at once (start several in parallel, then
    call `wait_ready()` on each)."""

    def __init__(self, args: list[str], log_path: Path, timeout_s: float = 120.0,
                 wait: bool = True) -> None:
        self.args = args
        self.log = open(log_path, "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", *args], cwd=REPO,
                                     env=env(), stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     start_new_session=True,
                                     preexec_fn=exit_with_parent(signal.SIGKILL))
        self.timeout_s = timeout_s
        self.port = 0
        if wait:
            self.wait_ready()

    def wait_ready(self) -> "Node":
        self.port = self._wait_port(self.timeout_s)
        self.address = f"127.0.0.1:{self.port}"
        return self

    def _wait_port(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if select.select([self.proc.stdout], [], [], 0.2)[0]:
                line = self.proc.stdout.readline()
                m = LISTENING.search(line)
                if m:
                    return int(m.group(1) or m.group(2))
                if not line and self.proc.poll() is not None:
                    break
            elif self.proc.poll() is not None:
                break
        self.stop()
        raise RuntimeError(f"pdserve {' '.join(self.args[:1])} did not start; see {self.log.name}:\n"
                           + Path(self.log.name).read_text()[-3000:])

    def pids(self) -> list[int]:
        """This process and all its descendants."""
        out, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            for task in Path(f"/proc/{pid}/task").glob("*"):
                try:
                    todo += [int(c) for c in (task / "children").read_text().split()]
                except OSError:
                    pass
        return out

    def stop(self, sig=signal.SIGTERM, grace_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc.stdout.close()
        self.log.close()


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of these processes, in seconds."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / tick

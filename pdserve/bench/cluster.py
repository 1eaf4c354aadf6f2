"""Local clusters for the comparison, each process pinned to its cores.

- `1p1d`: a prefill node on the first core, a decode node on the second, a router over both.
- `colocated`: two role-`both` nodes (`pdserve serve`), one per core, behind the same
  router binary. The router needs no special mode for them: a router with no prefill node
  gives every request `kv_window_end = 0`, so the decode edge of a `both` node prefills
  the whole prompt in its own engine (as a colocated node does) and generates.
Each worker is limited to its share: pinned with `sched_setaffinity` before it starts
(threads inherit it) and one torch/OpenMP thread per core. The router is pinned to all the
cores, which it shares with the workers. Every process runs in its own session and is
killed with its group when the cluster closes, whatever happened.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pdserve.up import LISTENING

REPO = Path(__file__).resolve().parents[2]
SYSTEMS = ("1p1d", "colocated")


def _env(threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


class PinnedProcess:
    """One `pdserve` process on `cores`; `wait_ready()` returns its HOST:PORT."""

    def __init__(self, name: str, args: list[str], cores: set[int], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", *args], env=_env(len(cores)),
            stdout=subprocess.PIPE, stderr=self._log, text=True, start_new_session=True,
            preexec_fn=lambda: os.sched_setaffinity(0, cores))
        self.address = ""

    def wait_ready(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if select.select([self.proc.stdout], [], [], 0.2)[0]:
                line = self.proc.stdout.readline()
                match = LISTENING.search(line)
                if match:
                    self.address = f"127.0.0.1:{match.group(3)}"
                    return self.address
                if not line and self.proc.poll() is not None:
                    break
            elif self.proc.poll() is not None:
                break
        tail = self.log_path.read_text()[-2000:]
        raise RuntimeError(f"{self.name} did not start (exit code {self.proc.poll()}); "
                           f"{self.log_path}:\n{tail}")

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        self.proc.stdout.close()
        self._log.close()


@contextmanager
def start_cluster(system: str, model: str, cores: tuple[int, int], log_dir: Path,
                  node_args: list[str] = (), router_args: list[str] = (),
                  timeout_s: float = 300.0) -> Iterator[str]:
    """Start `system` and yield the router's address; stop every process on exit."""
    if system not in SYSTEMS:
        raise ValueError(f"system must be one of {SYSTEMS}, got {system!r}")
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    roles = ("prefill", "decode") if system == "1p1d" else ("serve", "serve")
    procs: list[PinnedProcess] = []
    try:
        for i, (role, core) in enumerate(zip(roles, cores)):
            args = [role, "--model", model, "--host", "127.0.0.1", "--port", "0",
                    "--num-threads", "1", *node_args]
            procs.append(PinnedProcess(f"{system}-{role}{i}-core{core}", args, {core}, log_dir))
        first, second = (p.wait_ready(timeout_s) for p in procs)
        if system == "1p1d":
            endpoints = ["--prefill", first, "--decode", second]
        else:
            endpoints = ["--decode", first, "--decode", second]
        router = PinnedProcess(f"{system}-router", ["router", "--model", model, "--host", "127.0.0.1",
                                                    "--port", "0", *endpoints, *router_args],
                               set(cores), log_dir)
        procs.append(router)
        yield router.wait_ready(timeout_s)
    finally:
        for p in reversed(procs):
            p.stop()

"""vLLM's OpenAI server as the third system of `pdserve bench serve --compare --compare-peer
vllm`: the engine users would run instead, on the same cores, model and dtype.

It runs with the peer's own interpreter (`make bench-peers`; `benchmarks.peer`) in its own
session, bound to the comparison's cores (`VLLM_CPU_OMP_THREADS_BIND`) with the KV space
`--peer-kv-cache-gib`, offline, its log in the run's log directory; it is stopped with its
whole process group when the run ends, whatever happened. vLLM's own defaults stand
otherwise (its scheduler, its prefix caching), as a user would run it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pdserve.benchmarks.peer import GiB, cpu_list, peer_env
from pdserve.procs import free_port

SERVED_NAME = "peer"


@contextmanager
def start_vllm_server(python: Path, model_dir: str, dtype: str, cores: tuple[int, ...],
                      log_dir: Path, kv_cache_gib: int, max_model_len: int,
                      timeout_s: float = 900.0) -> Iterator[str]:
    """Start the server and yield its base URL once `/v1/models` answers."""
    port = free_port()
    env = {**os.environ, **peer_env(kv_cache_gib * GiB // 2, python)}  # peer_env doubles it
    env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list(sorted(cores))
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
               "--served-model-name", SERVED_NAME, "--dtype", dtype, "--host", "127.0.0.1",
               "--port", str(port), "--max-model-len", str(max_model_len)]
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / "vllm-server.log", "w") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=log_dir)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, url, timeout_s, log_dir / "vllm-server.log")
        yield url
    finally:
        _stop(proc)


def _wait_ready(proc: subprocess.Popen, url: str, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with status {proc.returncode}; its "
                               f"log: {log}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1.0)  # a start-up of minutes: polled once a second
    raise RuntimeError(f"the vLLM server did not answer within {timeout_s:.0f} s; its log: {log}")


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue

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
def start_vllm_server(python: Path, model_dir: str, dtype: str, cores: tuple[frozenset[int], frozenset[int]],
                      log_dir: Path, kv_cache_gib: int, max_model_len: int,
                      timeout_s: float = 900.0) -> Iterator[str]:
    """Start the server on both sides' cores and yield its base URL once `/v1/models`
    answers."""
    proc, url = launch_vllm(python, model_dir, dtype, tuple(sorted(cores[0] | cores[1])), log_dir / "vllm-server.log",
                            kv_cache_gib, max_model_len)
    try:
        wait_ready(proc, url, timeout_s, log_dir / "vllm-server.log")
        yield url
    finally:
        stop(proc)


def launch_vllm(python: Path, model_dir: str, dtype: str, cores, log: Path, kv_cache_gib: int,
                max_model_len: int, extra_args: list[str] = (), extra_env: dict | None = None,
                pin: bool = False) -> tuple[subprocess.Popen, str]:
    """Start one vLLM OpenAI server (not waiting for it): its process and base URL. With
    `pin`, the whole process tree is bound to `cores` too (`pdserve.launch`), not only
    vLLM's OpenMP threads."""
    from pdserve import launch

    port = free_port()
    env = {**os.environ, **peer_env(kv_cache_gib * GiB // 2, python)}  # peer_env doubles it
    env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list(sorted(cores))
    env.update(extra_env or {})
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
               "--served-model-name", SERVED_NAME, "--dtype", dtype, "--host", "127.0.0.1",
               "--port", str(port), "--max-model-len", str(max_model_len), *extra_args]
    if pin:
        command = launch.command(command, parent_death=signal.SIGTERM, cores=set(cores))
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=log.parent)
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(proc: subprocess.Popen, url: str, timeout_s: float, log: Path,
               what: str = "the vLLM server") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} {url} exited with status {proc.returncode}; its "
                               f"log: {log}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1.0)  # a start-up of minutes: polled once a second
    raise RuntimeError(f"{what} {url} did not answer within {timeout_s:.0f} s; its log: {log}")


def stop(proc: subprocess.Popen) -> None:
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

"""vLLM as 1P1D, the peer of `bench serve --compare --compare-peer vllm-pd`: a prefill
server on the first core and a decode server on the second, joined by vLLM's
NixlConnector, behind our proxy (`pd_proxy`), which the load generator talks to like any
OpenAI server.

Each server is one `vllm.entrypoints.openai.api_server` with
`--kv-transfer-config {"kv_connector": "NixlConnector", "kv_role": "kv_both",
"kv_buffer_device": "cpu"}`, its own NIXL side-channel port (`VLLM_NIXL_SIDE_CHANNEL_PORT`)
and half the peer's KV space. Pinned like pdserve's 1P1D nodes: the whole process tree on
its core (`pdserve.launch --cores`, as `cluster` pins pdserve's nodes) and vLLM's one
OpenMP thread there too (`VLLM_CPU_OMP_THREADS_BIND`). The proxy runs on both cores, as
pdserve's router does.

Measured at its best: `vllm_pd_site` runs as the servers' `sitecustomize` and undoes two
things of vLLM 0.32's CPU path (nothing installed is edited):
- the NIXL worker's `os.sched_setaffinity(0, [last core of each NUMA node])`, which would
  put both model threads on one core: the thread keeps its server's core;
- nixl's zero progress-thread poll delay, which spins a core per server while idle: the
  delay becomes `NIXL_PTHR_DELAY_US`, the default of pdserve's own agent.
Every process is stopped with its process group when the run ends, whatever happened.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from pdserve.benchmarks.serve import vllm_pd_site
from pdserve.benchmarks.serve.peer_server import launch_vllm, stop, wait_ready
from pdserve.procs import free_port

NIXL_PTHR_DELAY_US = 2000  # kvtransfer/agent.py's progress_delay_us
KV_TRANSFER_CONFIG = {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                      "kv_buffer_device": "cpu"}


def site_dir(log_dir: Path) -> Path:
    """A directory holding `vllm_pd_site` as `sitecustomize.py`, for the servers' PYTHONPATH."""
    site = log_dir / "vllm-pd-site"
    site.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(vllm_pd_site.__file__, site / "sitecustomize.py")
    return site


def server_env(site: Path, cores, side_channel_port: int) -> dict[str, str]:
    import os

    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": f"{site}:{path}" if path else str(site),
            vllm_pd_site.CORES_ENV: ",".join(map(str, sorted(cores))),
            vllm_pd_site.DELAY_ENV: str(NIXL_PTHR_DELAY_US),
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port)}


@contextmanager
def start_vllm_pd(python: Path, model_dir: str, dtype: str, cores: tuple[frozenset[int], frozenset[int]],
                  log_dir: Path, kv_cache_gib: int, max_model_len: int,
                  timeout_s: float = 900.0) -> Iterator[str]:
    """Start both servers and the proxy; yield the proxy's base URL once it answers."""
    from pdserve import launch

    log_dir = Path(log_dir)
    site = site_dir(log_dir)
    kv_gib = max(1, kv_cache_gib // 2)
    extra = ["--kv-transfer-config", json.dumps(KV_TRANSFER_CONFIG)]
    with ExitStack() as stack:
        servers = []
        for role, side in (("prefill", cores[0]), ("decode", cores[1])):
            log = log_dir / f"vllm-pd-{role}-core{'-'.join(map(str, sorted(side)))}.log"
            proc, url = launch_vllm(python, model_dir, dtype, tuple(sorted(side)), log, kv_gib, max_model_len,
                                    extra, server_env(site, side, free_port()), pin=True)
            stack.callback(stop, proc)
            servers.append((proc, url, log))
        for proc, url, log in servers:  # both load at once, each on its own core
            wait_ready(proc, url, timeout_s, log)
        port = free_port()
        command = launch.command([sys.executable, "-m", "pdserve.benchmarks.serve.pd_proxy",
                                  "--prefill", servers[0][1], "--decode", servers[1][1],
                                  "--port", str(port)],
                                 parent_death=signal.SIGTERM, cores=set(cores[0] | cores[1]))
        with open(log_dir / "vllm-pd-proxy.log", "w") as out:
            proxy = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        stack.callback(stop, proxy)
        url = f"http://127.0.0.1:{port}"
        wait_ready(proxy, url, 60.0, log_dir / "vllm-pd-proxy.log", "the proxy")
        yield url

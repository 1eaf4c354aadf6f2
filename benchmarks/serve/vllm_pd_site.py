"""The `sitecustomize` of vLLM's 1P1D servers in `bench serve --compare-peer vllm-pd`: it
measures the peer at its best by undoing two things of vLLM 0.32's CPU path with NIXL,
without editing the installed vLLM or NIXL files.

`peer_pd` copies this file as `sitecustomize.py` into a directory of the run's log
directory and puts that first on the servers' PYTHONPATH, so every process of a server
(API server, engine core) runs it at start-up. It imports nothing of pdserve (it runs in
the peer's venv) and does nothing unless its variables are set:

- `PDSERVE_PEER_CORES` ("0"): the cores the server was pinned to. vLLM's NIXL worker
  (`NixlBaseConnectorWorker.__init__` in `kv_connector/v1/nixl/base_worker.py`) calls
  `os.sched_setaffinity(0, [last core of each NUMA node])` on the model thread, which puts
  the prefill and the decode server's model threads both on the last core. The wrapper
  below keeps a thread's cores when asked to move it off them: a request is narrowed to
  the configured cores, and when that leaves none, the configured cores stand.
- `PDSERVE_PEER_NIXL_PTHR_DELAY_US` ("2000"): nixl's Python wrapper (`nixl_agent` in
  `nixl_cu*/_api.py`) sets the progress thread's poll delay `pthrDelay` to 0, so the
  thread spins a core even when idle. An import hook wraps `_bindings.nixlAgent` to give
  a config with the progress thread on and a zero delay this one, as pdserve's own agent
  does (`kvtransfer/agent.py`, `progress_delay_us`): the thread then sleeps in `poll()`
  between events instead of spinning.
Each fix says once on stderr that it acted, so the server's log shows it.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import re
import sys

CORES_ENV = "PDSERVE_PEER_CORES"
DELAY_ENV = "PDSERVE_PEER_NIXL_PTHR_DELAY_US"
BINDINGS = re.compile(r"^nixl(_cu\d+|_rocm)?\._bindings$")


def _say(text: str) -> None:
    print(f"pdserve peer sitecustomize [{os.getpid()}]: {text}", file=sys.stderr, flush=True)


def keep_cores(configured: set[int], requested) -> set[int]:
    """The cores a thread is given when asked for `requested`: those of them it was
    configured with, or all its configured ones when none is."""
    return (set(requested) & configured) or set(configured)


def install_affinity_guard(configured: set[int]) -> None:
    real = os.sched_setaffinity

    def sched_setaffinity(pid, mask):
        mask = set(mask)
        kept = keep_cores(configured, mask)
        if kept != mask:
            _say(f"kept cores {sorted(kept)} of pid/tid {pid or 'self'} (asked {sorted(mask)})")
        real(pid, kept)

    os.sched_setaffinity = sched_setaffinity


class _NixlDelayHook(importlib.abc.MetaPathFinder):
    """Wraps `nixlAgent` of nixl's bindings module as it is imported."""

    def __init__(self, delay_us: int) -> None:
        self.delay_us = delay_us

    def find_spec(self, name, path, target=None):
        if not BINDINGS.match(name):
            return None
        sys.meta_path.remove(self)  # find the real module, once
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        real_exec, delay_us = spec.loader.exec_module, self.delay_us

        def exec_module(module):
            real_exec(module)
            wrap_agent(module, delay_us)

        spec.loader.exec_module = exec_module
        return spec


def wrap_agent(bindings, delay_us: int) -> None:
    """`bindings.nixlAgent(name, config)` with a non-zero progress-thread delay."""
    real = bindings.nixlAgent

    def nixlAgent(name, config):  # noqa: N802 - the name nixl's `_api` calls
        if config.useProgThread and config.pthrDelay == 0:
            config.pthrDelay = delay_us
            _say(f"NIXL agent {name}: progress thread poll delay 0 -> {delay_us} us")
        return real(name, config)

    bindings.nixlAgent = nixlAgent


def install() -> None:
    cores = os.environ.get(CORES_ENV)
    if cores:
        install_affinity_guard({int(c) for c in cores.split(",")})
    delay = os.environ.get(DELAY_ENV)
    if delay and int(delay) > 0:
        sys.meta_path.insert(0, _NixlDelayHook(int(delay)))


if __name__ == "sitecustomize":
    install()

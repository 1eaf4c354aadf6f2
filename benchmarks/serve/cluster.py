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

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pdserve.procs import NodeProcess, stop_all

SYSTEMS = ("1p1d", "colocated")


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
    procs: list[NodeProcess] = []
    try:
        for i, (role, core) in enumerate(zip(roles, cores)):
            args = [role, "--model", model, "--host", "127.0.0.1", "--port", "0",
                    "--num-threads", "1", *node_args]
            procs.append(NodeProcess(args, log=log_dir / f"{system}-{role}{i}-core{core}.log",
                                     cores={core}, threads=1))
        first, second = (p.wait_ready(timeout_s) for p in procs)
        if system == "1p1d":
            endpoints = ["--prefill", first, "--decode", second]
        else:
            endpoints = ["--decode", first, "--decode", second]
        router = NodeProcess(["router", "--model", model, "--host", "127.0.0.1", "--port", "0",
                              *endpoints, *router_args], log=log_dir / f"{system}-router.log",
                             cores=set(cores), threads=len(cores))
        procs.append(router)
        yield router.wait_ready(timeout_s)
    finally:
        stop_all(procs[::-1])

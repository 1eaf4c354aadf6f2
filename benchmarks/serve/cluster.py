"""Local clusters for the comparison, each process pinned to its cores.

- `1p1d`: a prefill node on the first side's cores (one core on a CPU), a decode node on
  the second's, a router over both.
- `colocated`: one role-`both` node (`pdserve serve`) on both sides with a thread per core
  (the footprint of vLLM's server in the peer comparison), or with `colocated_nodes=2` two
  such nodes, one per side; behind the same router binary. The router needs no special
  mode for them: a router with no prefill node gives every request `kv_window_end = 0`, so
  the decode edge of a `both` node prefills the whole prompt in its own engine (as a
  colocated node does) and generates.
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
def start_cluster(system: str, model: str, cores: tuple[frozenset[int], frozenset[int]], log_dir: Path,
                  node_args: list[str] = (), router_args: list[str] = (),
                  timeout_s: float = 300.0, colocated_nodes: int = 1) -> Iterator[str]:
    """Start `system` and yield the router's address; stop every process on exit."""
    if system not in SYSTEMS:
        raise ValueError(f"system must be one of {SYSTEMS}, got {system!r}")
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    if colocated_nodes not in (1, 2):
        raise ValueError(f"colocated_nodes must be 1 or 2, got {colocated_nodes!r}")
    both = set(cores[0] | cores[1])
    if system == "1p1d":
        nodes = [("prefill", set(cores[0])), ("decode", set(cores[1]))]
    elif colocated_nodes == 2:
        nodes = [("serve", set(cores[0])), ("serve", set(cores[1]))]
    else:
        nodes = [("serve", both)]
    procs: list[NodeProcess] = []
    try:
        for i, (role, node_cores) in enumerate(nodes):
            args = [role, "--model", model, "--host", "127.0.0.1", "--port", "0",
                    "--num-threads", str(len(node_cores)), *node_args]
            where = "-".join(map(str, sorted(node_cores)))
            procs.append(NodeProcess(args, log=log_dir / f"{system}-{role}{i}-core{where}.log",
                                     cores=node_cores, threads=len(node_cores)))
        addresses = [p.wait_ready(timeout_s) for p in procs]
        if system == "1p1d":
            endpoints = ["--prefill", addresses[0], "--decode", addresses[1]]
        else:
            endpoints = [flag for address in addresses for flag in ("--decode", address)]
        router = NodeProcess(["router", "--model", model, "--host", "127.0.0.1", "--port", "0",
                              *endpoints, *router_args], log=log_dir / f"{system}-router.log",
                             cores=both, threads=len(both))
        procs.append(router)
        yield router.wait_ready(timeout_s)
    finally:
        stop_all(procs[::-1])

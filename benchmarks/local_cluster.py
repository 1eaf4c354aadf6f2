"""Router + prefill + decode as real processes on this host, and what their nodes report:
the cluster the GPU check (benchmarks/gpu_cluster.py) runs its stages on.

A `Cluster` starts its three nodes at once (worker ports picked up front, so the router
need not wait for them) and waits for them when a stage first needs them; `stop` ends every
node of every cluster together, frozen ones too. Each node logs to `log_dir/NAME-ROLE.log`.
Waits are bounded: `wait_full` and `until` give up after their timeout.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.procs import NodeProcess, free_port, stop_all


@dataclass
class Cluster:
    """Router + prefill + decode on this host serving one model, started at once (worker
    ports picked up front, so the router need not wait for them)."""

    name: str
    model: str
    worker: list[str]
    log_dir: Path
    prefill_flags: list[str] = field(default_factory=list)
    decode_flags: list[str] = field(default_factory=list)
    router_flags: list[str] = field(default_factory=list)
    nodes: dict[str, NodeProcess] = field(default_factory=dict)

    def start(self) -> "Cluster":
        ports = {"prefill": free_port(), "decode": free_port()}
        flags = {"prefill": self.prefill_flags, "decode": self.decode_flags}
        for role in ("prefill", "decode"):
            self._node(role, [role, "--model", self.model, "--host", "127.0.0.1", "--port",
                              str(ports[role]), *self.worker, *flags[role]])
        self._node("router", ["router", "--model", self.model, "--host", "127.0.0.1", "--port", "0",
                              "--prefill", f"127.0.0.1:{ports['prefill']}",
                              "--decode", f"127.0.0.1:{ports['decode']}", "--health-interval-s", "0.3",
                              *self.router_flags])
        return self

    def _node(self, role: str, args: list[str]) -> None:
        self.nodes[role] = NodeProcess(args, log=self.log_dir / f"{self.name}-{role}.log")

    def wait(self, deadline: float) -> None:
        for node in self.nodes.values():
            if not node.address:
                node.wait_ready(max(1.0, deadline - time.monotonic()))

    def address(self, role: str) -> str:
        return self.nodes[role].address

    def request_records(self, role: str) -> list[dict]:
        """The request lines of a node started with `--log-format json` (runtime/logs.py),
        oldest first."""
        records = []
        for line in self.nodes[role].log_path.read_text(errors="replace").splitlines():
            if line.startswith("{") and '"request_id"' in line:
                try:
                    records.append(json.loads(line))
                except ValueError:
                    continue  # a line cut by a crash
        return records

    def log_tails(self, chars: int = 1500) -> dict[str, str]:
        tails = {}
        for role, node in self.nodes.items():
            try:
                tails[role] = node.log_path.read_text(errors="replace")[-chars:]
            except OSError as err:
                tails[role] = repr(err)
        return tails


def stop(clusters: list[Cluster]) -> None:
    """Every node of every cluster, at once (SIGTERM, SIGKILL after 5 s)."""
    nodes = [node for cluster in clusters for node in list(cluster.nodes.values())[::-1]]
    for node in nodes:
        node.send_signal(signal.SIGCONT)  # a frozen node takes no SIGTERM
    stop_all(nodes, grace_s=5.0)


# ---- what the nodes report --------------------------------------------------------------
async def load(address: str):
    from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
    from pdserve.runtime.server import channel

    async with channel(address) as ch:
        return await pdserve_pb2_grpc.WorkerStub(ch).GetLoad(pdserve_pb2.LoadRequest(), timeout=5)


def pool_of(report) -> dict:
    return {"free_pages": report.free_pages, "total_pages": report.total_pages,
            "running": report.num_running, "parked": report.num_parked,
            "quarantined": report.num_quarantined}


def is_full(pool: dict) -> bool:
    return pool["free_pages"] == pool["total_pages"] and not (pool["running"] or pool["parked"]
                                                               or pool["quarantined"])


async def wait_full(addresses: list[str], timeout_s: float) -> list[dict]:
    """Each pool once all are full (nothing running, parked or quarantined), or as last
    seen when `timeout_s` passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        pools = [pool_of(await load(a)) for a in addresses]
        if all(is_full(p) for p in pools) or time.monotonic() >= deadline:
            return pools
        await asyncio.sleep(0.1)


def bytes_per_token(report) -> int:
    from pdserve.kvtransfer.layout import DTYPE_SIZES

    layout = report.identity.layout
    return 2 * layout.num_layers * layout.num_kv_heads * layout.head_dim * DTYPE_SIZES[layout.dtype]


def frozen(node: NodeProcess) -> bool:
    """Whether the node's process is stopped (SIGSTOP: state T in /proc)."""
    try:
        return Path(f"/proc/{node.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


async def until(condition, what: str, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while not (value := await condition()):
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} not within {timeout_s} s")
        await asyncio.sleep(0.02)
    return value


async def open_gate(address: str, phase: str, request_id: str) -> None:
    """Let `request_id` pass test gate `phase` of the node at `address` (runtime/gates.py)."""
    from pdserve.proto import testing_pb2, testing_pb2_grpc
    from pdserve.runtime.server import channel

    async with channel(address) as ch:
        await testing_pb2_grpc.GatesStub(ch).Open(testing_pb2.Gate(phase=phase, request_id=request_id),
                                                  timeout=5)

"""A fault-test cluster: 2 prefill + 2 decode nodes and 2 routers, as real processes.

Nodes can be killed and restarted on the same port (so the routers' endpoint lists stay
valid). Prefill nodes delay RemoteSends of request ids starting with `SLOW` (1.5 s before
the prefill and 1.5 s before the KV write, hidden `--debug-delay-*` flags) so a test can
act while a request is in a given phase. Router `main` leases reservations for 8 s,
router `short` for 2 s (lease-expiry tests); decode nodes quarantine freed reservations
until 3 s past their lease.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc

from pdserve.server import channel
from proto import pdserve_pb2, pdserve_pb2_grpc
from tests.e2e.procs import Node

SLOW = "slow-"
PHASE_DELAY_S = 1.5
GRACE_MS = 3000
WORKER_FLAGS = ["--num-threads", "1", "--num-pages", "128", "--page-size", "8",
                "--max-num-seqs", "64"]
PREFILL_FLAGS = ["--debug-delay-prefill-ms", str(int(PHASE_DELAY_S * 1000)),
                 "--debug-delay-kv-write-ms", str(int(PHASE_DELAY_S * 1000)),
                 "--debug-delay-prefix", SLOW]
DECODE_FLAGS = ["--quarantine-grace-ms", str(GRACE_MS)]
ROUTER_FLAGS = ["--health-interval-s", "0.3", "--max-concurrent-requests", "64"]
GREEDY = dict(temperature=0.0, ignore_eos=True)


class Cluster:
    def __init__(self, model: str, logs: Path) -> None:
        self.model = model
        self.logs = logs
        self.nodes: dict[str, Node] = {}
        self.args: dict[str, list[str]] = {}
        try:
            for name in ("p1", "p2", "d1", "d2"):
                role = "prefill" if name[0] == "p" else "decode"
                extra = PREFILL_FLAGS if role == "prefill" else DECODE_FLAGS
                self._start(name, [role, "--model", model, "--host", "127.0.0.1",
                                   *WORKER_FLAGS, *extra], port=0, wait=False)
            for name in ("p1", "p2", "d1", "d2"):
                self.nodes[name].wait_ready()
            for name, lease in (("main", 8000), ("short", 2000)):
                self._start(name, ["router", "--model", model, "--host", "127.0.0.1",
                                   "--prefill", f"{self.address('p1')},{self.address('p2')}",
                                   "--decode", f"{self.address('d1')},{self.address('d2')}",
                                   "--lease-ms", str(lease), *ROUTER_FLAGS], port=0, wait=False)
            for name in ("main", "short"):
                self.nodes[name].wait_ready()
        except BaseException:
            self.stop()
            raise

    def _start(self, name: str, args: list[str], port: int, wait: bool) -> Node:
        self.args[name] = args
        log = self.logs / f"{name}-{int(time.time() * 1000)}.log"
        node = Node([*args, "--port", str(port)], log, wait=wait)
        self.nodes[name] = node
        return node

    def address(self, name: str) -> str:
        return self.nodes[name].address

    @property
    def workers(self) -> list[str]:
        return [self.address(n) for n in ("p1", "p2", "d1", "d2")]

    def kill(self, name: str) -> None:
        import os
        import signal

        node = self.nodes[name]
        os.killpg(node.proc.pid, signal.SIGKILL)
        node.proc.wait()

    def restart(self, name: str) -> None:
        """Start `name` again on the port it had (after `kill`)."""
        old = self.nodes[name]
        old.stop()
        self._start(name, self.args[name], port=old.port, wait=True)

    def stop(self) -> None:
        for node in reversed(list(self.nodes.values())):
            node.stop()


async def load(address: str) -> pdserve_pb2.LoadReport:
    async with channel(address) as ch:
        return await pdserve_pb2_grpc.WorkerStub(ch).GetLoad(pdserve_pb2.LoadRequest(), timeout=10)


async def wait_pools_full(addresses, timeout_s: float = 15.0) -> list[pdserve_pb2.LoadReport]:
    """Poll until every pool is full and nothing is parked or quarantined; the last reports."""
    deadline = time.monotonic() + timeout_s
    while True:
        reports = [await load(a) for a in addresses]
        if all(full(r) for r in reports) or time.monotonic() > deadline:
            return reports
        await asyncio.sleep(0.1)


def full(report: pdserve_pb2.LoadReport) -> bool:
    return (report.free_pages == report.total_pages and report.num_parked == 0
            and report.num_quarantined == 0 and report.num_running == 0)


async def wait_for(predicate, timeout_s: float, poll_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(poll_s)
    raise AssertionError(f"condition not met within {timeout_s}s")


def worker_stub(ch: grpc.aio.Channel) -> pdserve_pb2_grpc.WorkerStub:
    return pdserve_pb2_grpc.WorkerStub(ch)

"""The one helper of the multi-process tests: named pdserve nodes as real processes on
loopback (`pdserve.procs.NodeProcess`), what the tests ask of them, and how a test waits.

- `Cluster`: start nodes by name (several at once, then wait for all, so their start-ups
  overlap), kill one, restart it on the port it had (routers' endpoint lists stay valid),
  stop everything at the end whatever happened. Each node logs to `<logs>/<name>.log`.
- `load`, `full`, `wait_pools_full`: a worker's LoadReport, and waiting until every pool
  is full again with nothing parked, running or quarantined.
- `gate_reached`, `gate_open`: the test gates of a node started with `--test-gates`
  (runtime/gates.py): wait until a request stops at a phase, then let it go on.
- `wait_for`: poll a condition (a real one: the node's own report) until it holds.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from pdserve.procs import NodeProcess, stop_all
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc, testing_pb2, testing_pb2_grpc
from pdserve.runtime.server import channel

WORKER_FLAGS = ["--num-threads", "1", "--num-pages", "256", "--page-size", "8"]
GREEDY = dict(temperature=0.0, ignore_eos=True)
# Why a request may correctly skip its prefill node on a machine loaded by other work (the
# route's skip_reason): its RemoteSend outlived the lease ("fallback", "lease_ended"), or
# the prefill node looked saturated or, slow to answer its health check after that, gone
# ("prefill_saturated", "no_prefill"). A test that allows it asserts the answer and this.
SKIPPED_UNDER_LOAD = frozenset({"fallback", "lease_ended", "prefill_saturated", "no_prefill"})


class Cluster:
    def __init__(self, logs: Path, model: str) -> None:
        self.logs = Path(logs)
        self.model = model
        self.nodes: dict[str, NodeProcess] = {}
        self.args: dict[str, list[str]] = {}
        self.envs: dict[str, dict[str, str] | None] = {}
        self.netns: dict[str, str | None] = {}

    def start(self, name: str, args: list[str], port: int = 0, wait: bool = True,
              env: dict[str, str] | None = None, netns: str | None = None) -> NodeProcess:
        """Start node `name` (`pdserve ARGS --port PORT`, our environment plus `env`, in
        network namespace `netns` if given); with `wait`, until it listens."""
        self.args[name], self.envs[name], self.netns[name] = list(args), env, netns
        node = NodeProcess([*args, "--port", str(port)], log=self.logs / f"{name}.log",
                           env={**os.environ, **env} if env else None, netns=netns)
        self.nodes[name] = node
        if wait:
            node.wait_ready()
        return node

    def wait(self, *names: str) -> None:
        for name in names:
            self.nodes[name].wait_ready()

    def address(self, name: str) -> str:
        return self.nodes[name].address

    def kill(self, name: str) -> None:
        self.nodes[name].kill()

    def restart(self, name: str) -> None:
        """Start `name` again on the port it had (after `kill` or an exit)."""
        old = self.nodes[name]
        old.stop()
        (self.logs / f"{name}.log").rename(self.logs / f"{name}-{int(time.time() * 1000)}.log")
        self.start(name, self.args[name], port=old.port, env=self.envs[name], netns=self.netns[name])

    def stop_node(self, name: str) -> None:
        node = self.nodes.pop(name, None)
        if node is not None:
            node.stop()

    def stop(self) -> None:
        stop_all(list(self.nodes.values())[::-1])

    def log_text(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text()


async def load(address: str) -> pdserve_pb2.LoadReport:
    async with channel(address) as ch:
        return await pdserve_pb2_grpc.WorkerStub(ch).GetLoad(pdserve_pb2.LoadRequest(), timeout=10)


def full(report: pdserve_pb2.LoadReport) -> bool:
    return (report.free_pages == report.total_pages and report.num_parked == 0
            and report.num_quarantined == 0 and report.num_running == 0)


async def wait_for(predicate, timeout_s: float, poll_s: float = 0.05):
    """The first truthy value of `await predicate()`; fails after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(poll_s)
    raise AssertionError(f"condition not met within {timeout_s}s")


async def wait_pools_full(addresses, timeout_s: float = 60.0) -> list[pdserve_pb2.LoadReport]:
    """Wait until every pool is full and nothing is parked or quarantined; the last reports
    (the caller asserts them, so a timeout shows what was left). The bound is against a
    leak, not a claim of speed: a loaded machine may take many times the usual second."""
    reports: list = []

    async def all_full():
        reports[:] = [await load(a) for a in addresses]
        return all(full(r) for r in reports)

    try:
        await wait_for(all_full, timeout_s, poll_s=0.1)
    except AssertionError:
        pass
    return reports


async def gate_reached(address: str, phase: str, request_id: str, timeout_s: float = 30.0) -> None:
    """Wait until `request_id` stops at gate `phase` of the node at `address`."""
    async with channel(address) as ch:
        await testing_pb2_grpc.GatesStub(ch).Reached(
            testing_pb2.Gate(phase=phase, request_id=request_id), timeout=timeout_s)


async def gate_open(address: str, phase: str, request_id: str) -> None:
    """Let `request_id` go on past gate `phase` (or pass it when it gets there)."""
    async with channel(address) as ch:
        await testing_pb2_grpc.GatesStub(ch).Open(
            testing_pb2.Gate(phase=phase, request_id=request_id), timeout=10)


async def open_gates(cluster: Cluster, phase: str, request_id: str,
                     nodes: tuple[str, ...] = ("p1", "p2")) -> None:
    """Let `request_id` pass gate `phase` on every one of `nodes` (before it gets there)."""
    for name in nodes:
        await gate_open(cluster.address(name), phase, request_id)


async def stopped_at(cluster: Cluster, phase: str, request_id: str,
                     nodes: tuple[str, ...] = ("p1", "p2")) -> str:
    """Which of `nodes` `request_id` stops at, at gate `phase` (waits until it does)."""
    waits = {asyncio.ensure_future(gate_reached(cluster.address(n), phase, request_id)): n
             for n in nodes}
    done, pending = await asyncio.wait(waits, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    assert done, f"{request_id} never reached gate {phase!r}"
    return waits[done.pop()]


def worker_stub(ch: grpc.aio.Channel) -> pdserve_pb2_grpc.WorkerStub:
    return pdserve_pb2_grpc.WorkerStub(ch)


def scrape(url: str) -> dict[tuple, float]:
    """Every sample of a /metrics page: (name, sorted label items) -> value."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def run(coro, timeout_s: float = 120.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def wait_until(condition, what, timeout_s: float = 10.0):
    """Poll `condition()` until it returns something truthy (returned), or fail naming `what`
    (a string, or a callable giving one: what was last seen). Nodes record a stream's end
    just after its last message reaches the client."""
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for "
                                 f"{what() if callable(what) else what}")
        time.sleep(0.05)
    return result


def sample(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)

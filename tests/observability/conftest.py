"""A disaggregated cluster for observability tests: router (gRPC + HTTP), prefill and decode
as real processes on loopback, every node with /metrics and JSON logs, killed at the end."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.up import free_port
from tests.e2e.procs import WORKER_FLAGS, Node


class ObservedCluster:
    def __init__(self, nodes: dict[str, Node], metrics_ports: dict[str, int], logs: Path):
        self.nodes, self.metrics_ports, self.logs = nodes, metrics_ports, logs
        self.grpc = nodes["router"].address
        self.http = f"http://127.0.0.1:{metrics_ports['router']}"

    def scrape(self, node: str) -> dict[tuple, float]:
        """Every sample of `node`'s /metrics: (name, sorted label items) -> value."""
        url = f"http://127.0.0.1:{self.metrics_ports[node]}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def log_lines(self, node: str) -> list[str]:
        return (self.logs / f"{node}.log").read_text().splitlines()


def wait_until(condition, what: str, timeout_s: float = 10.0):
    """Poll `condition()` until it returns something truthy (returned), or fail naming `what`.
    Nodes record a stream's end just after its last message reaches the client."""
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.05)
    return result


def sample(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="session")
def observed_cluster(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("obs-logs")
    ports = {role: free_port() for role in ("router", "prefill", "decode")}
    common = ["--model", tiny_model, "--host", "127.0.0.1", "--port", "0", "--log-format", "json"]
    nodes: dict[str, Node] = {}
    try:
        for role in ("prefill", "decode"):  # start both, then wait: their start-ups overlap
            nodes[role] = Node([role, *common, *WORKER_FLAGS, "--metrics-port", str(ports[role])],
                               logs / f"{role}.log", wait=False)
        for role in ("prefill", "decode"):
            nodes[role].wait_ready()
        nodes["router"] = Node(["router", *common, "--http-port", str(ports["router"]),
                                "--prefill", nodes["prefill"].address,
                                "--decode", nodes["decode"].address], logs / "router.log")
        yield ObservedCluster(nodes, ports, logs)
    finally:
        for node in reversed(list(nodes.values())):
            node.stop()

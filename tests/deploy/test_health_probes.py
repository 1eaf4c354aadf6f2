"""The health checks the deployment files declare work against running nodes: the
Dockerfile's HEALTHCHECK command, and the Kubernetes `grpc:` probes (which call
grpc.health.v1.Health/Check on the probe's port and service, as the kubelet does)."""

from __future__ import annotations

import json
import subprocess

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.deploy.compose_local import REPO, dockerfile_instruction, health_command
from tests.deploy.manifests import containers


def dockerfile_healthcheck() -> list[str]:
    text = dockerfile_instruction("HEALTHCHECK")
    return json.loads(text[text.index("CMD") + 3:])


def test_dockerfile_healthcheck_passes_on_every_running_node(compose):
    command = health_command(["CMD", *dockerfile_healthcheck()])
    for name, service in compose.services.items():
        result = subprocess.run(command, cwd=REPO, env=service.env, capture_output=True,
                                text=True, timeout=30)
        assert result.returncode == 0, f"{name}: {result.stdout}{result.stderr}"


def test_dockerfile_healthcheck_fails_where_nothing_serves(compose):
    env = dict(compose.services["router"].env, PDSERVE_PORT="1")
    result = subprocess.run(health_command(["CMD", *dockerfile_healthcheck()]), cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert "UNAVAILABLE" in result.stderr


def test_kubernetes_grpc_probes_pass_on_the_matching_running_nodes(compose):
    checked = 0
    for component, container in containers():
        service = compose.services[component]  # the compose service of the same role
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert int(env["PDSERVE_PORT"]) == compose.ports[component][0]
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container[kind]["grpc"]
            assert probe["port"] == int(env["PDSERVE_PORT"]), f"{component} {kind} port"
            with grpc.insecure_channel(service.address) as ch:
                reply = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=probe.get("service", "")), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, f"{component} {kind}"
            checked += 1
    assert checked == 9

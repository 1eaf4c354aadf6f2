"""The health checks the deployment files declare work against running nodes: the
Dockerfile's HEALTHCHECK, the compose healthchecks and the Kubernetes exec probes, each run
as written (`pdserve health` in the node's environment), against the compose services and
against a TLS node and a mutual-TLS node configured, as a container is, by their
`PDSERVE_TLS_*` variables alone. A check that cannot reach the node fails, saying which TLS
flags (and variables) it would need."""

from __future__ import annotations

import json
import os
import subprocess
from collections import defaultdict

import pytest

from tests.certs import CA
from tests.cluster.nodes import WORKER_FLAGS, Cluster
from tests.deploy.compose_local import (PORT_VARIABLES, REPO, dockerfile_instruction,
                                        health_command, load_compose, nodes)
from tests.deploy.manifests import by_kind, containers

PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def dockerfile_healthcheck() -> list[str]:
    text = dockerfile_instruction("HEALTHCHECK")
    return json.loads(text[text.index("CMD") + 3:])


def declared_health_checks() -> dict[str, list[str]]:
    """Every health check of deploy/ as a local command line, keyed by where it is declared."""
    tests = {"Dockerfile HEALTHCHECK": ["CMD", *dockerfile_healthcheck()]}
    for name, spec in nodes(load_compose({})).items():
        tests[f"compose {name}"] = spec["healthcheck"]["test"]
    for component, container in containers():
        for kind in PROBES:
            tests[f"k8s {component} {kind}"] = ["CMD", *container[kind]["exec"]["command"]]
    return {where: health_command(test) for where, test in tests.items()}


def check(command: list[str], env: dict[str, str], port: int) -> subprocess.CompletedProcess:
    """`command` as the container runs it: with its PDSERVE_* variables (`env`) only, on
    the port the node serves."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**base, "PYTHONPATH": str(REPO), **env, "PDSERVE_PORT": str(port)})


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


def test_kubernetes_probes_pass_on_the_matching_running_nodes(compose):
    """Each probe runs in its pod's environment (the ConfigMap, then the container's `env`),
    on the compose node of the same role; the port it asks is the pod's PDSERVE_PORT."""
    config = by_kind("ConfigMap")[0]["data"]
    checked = 0
    for component, container in containers():
        service = compose.services[component]  # the compose service of the same role
        env = {**config, **{e["name"]: e.get("value") for e in container.get("env", [])}}
        assert int(env["PDSERVE_PORT"]) == compose.ports[component][0]
        # The ports it declares are those it serves, the same as compose's node of its role.
        served = {v: int(env[v]) for v in PORT_VARIABLES if v in env}
        assert sorted(p["containerPort"] for p in container["ports"]) == sorted(served.values())
        assert served == {v: inner for v, (inner, _) in compose.port_map[component].items()}
        for kind in PROBES:
            probe = container[kind]
            assert probe["timeoutSeconds"] >= 5, f"{component} {kind}: python needs the time"
            result = check(health_command(["CMD", *probe["exec"]["command"]]), env, service.port)
            assert result.returncode == 0, f"{component} {kind}: {result.stdout}{result.stderr}"
            assert "SERVING" in result.stdout
            checked += 1
    assert checked == 9


@pytest.fixture(scope="module")
def tls_nodes(tiny_model, tmp_path_factory):
    """`tls`: a colocated node serving TLS (as the router does to clients). `mtls`: a prefill
    worker that takes only callers with a certificate the CA signed, of the names it lists
    (as workers do). Each is configured by the variables a container would set; the
    fixture gives each node's variables and port, and certificates of another CA."""
    d = tmp_path_factory.mktemp("health-tls")
    ca, stranger = CA(), CA("stranger CA")
    paths = {"ca": d / "ca.pem", "stranger_ca": d / "stranger_ca.pem"}
    paths["ca"].write_bytes(ca.cert)
    paths["stranger_ca"].write_bytes(stranger.cert)
    for who, issuer in (("serve", ca), ("worker", ca), ("stranger", stranger)):
        issued = issuer.issue(f"pdserve {who}")
        for part in ("cert", "key"):
            paths[f"{who}_{part}"] = d / f"{who}_{part}.pem"
            paths[f"{who}_{part}"].write_bytes(getattr(issued, part))
    paths = {name: str(path) for name, path in paths.items()}

    def tls(who: str) -> dict[str, str]:
        return {"PDSERVE_TLS_CA": paths["ca"], "PDSERVE_TLS_CERT": paths[f"{who}_cert"],
                "PDSERVE_TLS_KEY": paths[f"{who}_key"]}

    envs = {"tls": tls("serve"),
            "mtls": {**tls("worker"), "PDSERVE_TLS_REQUIRE_CLIENT_CERT": "1",
                     "PDSERVE_TLS_ROUTER_NAMES": "pdserve router",
                     "PDSERVE_TLS_WORKER_NAMES": "pdserve worker"}}
    c = Cluster(d, tiny_model)
    try:
        for name, role in (("tls", "serve"), ("mtls", "prefill")):
            c.start(name, [role, "--model", tiny_model, "--host", "127.0.0.1", *WORKER_FLAGS],
                    env=envs[name], wait=False)
        c.wait("tls", "mtls")
        yield {"env": envs, "port": {n: c.nodes[n].port for n in envs}, "files": paths}
    finally:
        c.stop()


def test_every_declared_health_check_passes_on_a_tls_and_a_mutual_tls_node(tls_nodes):
    places = defaultdict(list)  # the files declare one command; run each distinct one once
    for where, command in declared_health_checks().items():
        places[tuple(command)].append(where)
    for command, wheres in places.items():
        for node in ("tls", "mtls"):
            result = check(list(command), tls_nodes["env"][node], tls_nodes["port"][node])
            assert result.returncode == 0, f"{wheres} on {node}: {result.stdout}{result.stderr}"
            assert "SERVING" in result.stdout


def test_health_check_without_the_tls_variables_fails_naming_them(tls_nodes):
    command = health_command(["CMD", *dockerfile_healthcheck()])
    plain = check(command, {}, tls_nodes["port"]["tls"])
    assert plain.returncode == 1
    assert "UNAVAILABLE" in plain.stderr and "asked in plaintext" in plain.stderr
    assert "--tls-ca [PDSERVE_TLS_CA]" in plain.stderr

    ca_only = {"PDSERVE_TLS_CA": tls_nodes["files"]["ca"]}
    no_cert = check(command, ca_only, tls_nodes["port"]["mtls"])
    assert no_cert.returncode == 1 and "UNAVAILABLE" in no_cert.stderr
    assert "without a client certificate" in no_cert.stderr
    assert "PDSERVE_TLS_CERT" in no_cert.stderr
    assert check(command, ca_only, tls_nodes["port"]["tls"]).returncode == 0, \
        "a node that requires no client certificate needs only the CA"


def test_health_check_with_the_wrong_tls_files_fails(tls_nodes):
    command = health_command(["CMD", *dockerfile_healthcheck()])
    files = tls_nodes["files"]
    other_ca = dict(tls_nodes["env"]["tls"], PDSERVE_TLS_CA=files["stranger_ca"])
    wrong_ca = check(command, other_ca, tls_nodes["port"]["tls"])
    assert wrong_ca.returncode == 1 and "UNAVAILABLE" in wrong_ca.stderr
    assert "signed by --tls-ca and valid for 127.0.0.1" in wrong_ca.stderr

    stranger = dict(tls_nodes["env"]["mtls"], PDSERVE_TLS_CERT=files["stranger_cert"],
                    PDSERVE_TLS_KEY=files["stranger_key"])
    refused = check(command, stranger, tls_nodes["port"]["mtls"])
    assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr
    assert "--tls-cert signed by the CA the node trusts" in refused.stderr

    missing = dict(tls_nodes["env"]["tls"], PDSERVE_TLS_CA=files["ca"] + ".missing")
    unread = check(command, missing, tls_nodes["port"]["tls"])
    assert unread.returncode == 1
    assert f"pdserve health: TLS file not found: {files['ca']}.missing" in unread.stderr

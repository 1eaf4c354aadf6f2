"""Every node's metrics can be scraped where it is deployed: compose's Prometheus
(deploy/prometheus.yml) names each metrics port the compose nodes serve, and each of its
targets answers /metrics on the compose services run as local processes; each Kubernetes
pod names its metrics port in the prometheus.io annotations, the same port its container
declares and its node serves. kustomization.yaml lists every manifest and makes the image
a parameter."""

from __future__ import annotations

import urllib.request

import yaml

from tests.deploy.compose_local import COMPOSE_FILE, load_compose, nodes, served_ports
from tests.deploy.manifests import K8S_DIR, KUSTOMIZATION, by_kind, containers, documents

PROMETHEUS_FILE = COMPOSE_FILE.parent / "prometheus.yml"
# Where a node serves /metrics: the router on its HTTP port (with the OpenAI API), a worker
# on its metrics port.
METRICS_VARIABLE = {"router": "PDSERVE_HTTP_PORT", "prefill": "PDSERVE_METRICS_PORT",
                    "decode": "PDSERVE_METRICS_PORT"}


def prometheus_targets() -> dict[str, tuple[str, str]]:
    """`SERVICE:PORT` -> (job, metrics path) of every DNS-discovered target."""
    config = yaml.safe_load(PROMETHEUS_FILE.read_text())
    return {f"{name}:{sd['port']}": (job["job_name"], job.get("metrics_path", "/metrics"))
            for job in config["scrape_configs"] for sd in job["dns_sd_configs"]
            for name in sd["names"]}


def compose_metrics_targets(compose: dict) -> set[str]:
    return {f"{name}:{served_ports(spec)[METRICS_VARIABLE[name]]}"
            for name, spec in nodes(compose).items()}


def test_prometheus_scrapes_every_metrics_port_the_compose_nodes_serve():
    compose = load_compose({})
    assert set(prometheus_targets()) == compose_metrics_targets(compose)
    assert {path for _, path in prometheus_targets().values()} == {"/metrics"}
    prometheus = compose["services"]["prometheus"]
    mounts = [v.split(":") for v in prometheus["volumes"]]
    config = [source for source, target, *_ in mounts
              if target == "/etc/prometheus/prometheus.yml"]  # where the image reads it
    assert [(COMPOSE_FILE.parent / c).resolve() for c in config] == [PROMETHEUS_FILE]
    # A type A lookup of a compose service name answers every replica (--scale decode=N).
    config = yaml.safe_load(PROMETHEUS_FILE.read_text())
    assert all(sd["type"] == "A" for job in config["scrape_configs"]
               for sd in job["dns_sd_configs"])


def test_every_prometheus_target_answers_metrics_on_the_running_services(compose):
    for target, (job, path) in prometheus_targets().items():
        service = target.split(":")[0]
        url = f"http://{compose.addresses[target]}{path}"
        with urllib.request.urlopen(url, timeout=30) as response:
            body = response.read().decode()
        assert f'role="{service}"' in body and "pdserve_node_info" in body, f"{job}: {url}"


def test_every_kubernetes_pod_is_annotated_with_the_metrics_port_it_serves():
    config = by_kind("ConfigMap")[0]["data"]
    deployments = {d["metadata"]["labels"]["app.kubernetes.io/component"]: d
                   for d in by_kind("Deployment")}
    for component, container in containers():
        annotations = deployments[component]["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true", component
        assert annotations["prometheus.io/path"] == "/metrics", component
        port = int(annotations["prometheus.io/port"])
        env = {**config, **{e["name"]: e["value"] for e in container["env"]}}
        assert int(env[METRICS_VARIABLE[component]]) == port, f"{component} serves elsewhere"
        assert port in [p["containerPort"] for p in container["ports"]], component


def test_kubernetes_router_service_exposes_the_openai_port():
    (router,) = [c for component, c in containers() if component == "router"]
    http = {p["name"]: p["containerPort"] for p in router["ports"]}["http"]
    assert int({e["name"]: e["value"] for e in router["env"]}["PDSERVE_HTTP_PORT"]) == http
    (service,) = [s for s in by_kind("Service") if s["metadata"]["name"] == "pdserve"]
    assert {"name": "http", "port": http, "targetPort": "http", "appProtocol": "http"} \
        in service["spec"]["ports"]


def kustomized_image(image: str, rules: list[dict]) -> str:
    """What kustomize's `images` transformer makes of a container's `image`."""
    name, _, tag = image.partition(":")
    for rule in rules:
        if rule["name"] == name:
            return f"{rule.get('newName', name)}:{rule.get('newTag', tag)}"
    return image


def test_kustomization_lists_every_manifest_and_makes_the_image_a_parameter():
    kustomization = yaml.safe_load(KUSTOMIZATION.read_text())
    assert kustomization["kind"] == "Kustomization"
    manifests = {p.name for p, _ in documents(top_level_only=True)}
    assert sorted(kustomization["resources"]) == sorted(manifests)
    assert all((K8S_DIR / r).is_file() for r in kustomization["resources"])
    rules = kustomization["images"]
    images = {c["image"] for _, c in containers()}
    assert {kustomized_image(i, rules) for i in images} == {"pdserve:latest"}
    pushed = [dict(rules[0], newName="registry.example.com/pdserve", newTag="v1")]
    assert {kustomized_image(i, pushed) for i in images} == {"registry.example.com/pdserve:v1"}

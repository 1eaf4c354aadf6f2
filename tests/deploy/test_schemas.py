"""The deployment files are valid for the tools that will read them: the compose file
against the Compose Specification's JSON schema (vendored by check-jsonschema), the
Kubernetes manifests against the Kubernetes API schemas (shipped by kubernetes-validate,
strict: unknown fields are errors). Each check is also shown to reject a broken copy."""

from __future__ import annotations

import copy
import re
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from pdserve.models.catalogue import DEFAULT_MODEL
from tests.deploy.compose_local import (COMPOSE_FILE, PORT_VARIABLES, interpolate, load_compose,
                                        nodes)
from tests.deploy.manifests import K8S_DIR, by_kind, containers, documents, uncommented

K8S_VERSION = kubernetes_validate.utils.latest_version()


def check_compose(path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema",
                           "vendor.compose-spec", str(path)], capture_output=True, text=True)


def test_compose_file_matches_the_compose_specification():
    result = check_compose(COMPOSE_FILE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_schema_check_rejects_a_misspelt_key(tmp_path):
    broken = yaml.safe_load(COMPOSE_FILE.read_text())
    broken["services"]["decode"]["shm-size"] = "2gb"  # the key is shm_size
    (tmp_path / "compose.yml").write_text(yaml.safe_dump(broken))
    assert check_compose(tmp_path / "compose.yml").returncode != 0


@pytest.mark.parametrize("path,doc", documents(),
                         ids=lambda v: v.name if hasattr(v, "name") else v["metadata"]["name"])
def test_manifest_matches_the_kubernetes_schema(path, doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_kubernetes_schema_check_rejects_an_unknown_field():
    deployment = copy.deepcopy(by_kind("Deployment")[0])
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_compose_serves_the_image_model_unless_given_a_directory():
    for name, spec in nodes(load_compose({})).items():
        assert spec["environment"]["PDSERVE_MODEL"] == DEFAULT_MODEL, name
        assert "PDSERVE_CACHE" not in spec["environment"], f"{name} hides the image's cache"
        assert "--model" not in spec["command"], name
    own = load_compose({"MODEL_DIR": "/data/llama"})["services"]["decode"]
    assert own["volumes"] == ["/data/llama:/data/llama:ro"]
    assert own["environment"]["PDSERVE_MODEL"] == "/data/llama"


def test_kubernetes_pods_serve_the_image_model_with_no_volume_to_fill():
    config = by_kind("ConfigMap")[0]["data"]
    assert config["PDSERVE_MODEL"] == DEFAULT_MODEL
    assert "PDSERVE_CACHE" not in config, "the image's cache holds the model"
    for component, container in containers():
        assert "--model" not in container["args"], component
        own = {*PORT_VARIABLES, "PDSERVE_TENSOR_PARALLEL_SIZE"}  # set per Deployment
        assert {e["name"] for e in container.get("env", [])} <= own, component
    for deployment in by_kind("Deployment"):
        volumes = deployment["spec"]["template"]["spec"].get("volumes", [])
        assert not [v for v in volumes if "persistentVolumeClaim" in v], \
            f"{deployment['metadata']['name']}: a claim nobody filled keeps pods pending"
    applied = {doc["kind"] for _, doc in documents(top_level_only=True)}
    assert "PersistentVolumeClaim" not in applied


def test_commented_model_dir_override_mounts_the_claim_where_pdserve_model_points():
    claim = by_kind("PersistentVolumeClaim")[0]["metadata"]["name"]
    model_dir = re.search(r"set this to (/[\w/]+)", (K8S_DIR / "configmap.yaml").read_text())
    assert model_dir, "configmap.yaml says which PDSERVE_MODEL serves the claim's checkpoint"
    deployments = [doc for role in ("router", "prefill", "decode")
                   for doc in uncommented(K8S_DIR / f"{role}.yaml")]
    for deployment in (d for d in deployments if d["kind"] == "Deployment"):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
        pod = deployment["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        (container,) = pod["containers"]
        mounts = [m for m in container["volumeMounts"]
                  if volumes[m["name"]].get("persistentVolumeClaim", {}).get("claimName") == claim]
        assert len(mounts) == 1 and mounts[0]["readOnly"], deployment["metadata"]["name"]
        assert model_dir.group(1).startswith(mounts[0]["mountPath"] + "/")


def test_compose_interpolation_follows_compose_rules():
    v = {"SET": "x", "EMPTY": ""}
    assert interpolate("${SET:-d} ${EMPTY:-d} ${EMPTY-d} ${NONE-d}", v) == "x d  d"
    assert interpolate("${SET:+a}|${EMPTY:+a}|${EMPTY+a}|$$SET|$SET", v) == "a||a|$SET|x"
    with pytest.raises(ValueError):
        interpolate("${NONE:?needed}", v)


def test_decode_scales_in_compose_and_kubernetes():
    decode = load_compose({})["services"]["decode"]
    # A fixed container name or published port would stop `--scale decode=N`.
    assert "container_name" not in decode and "ports" not in decode
    router_env = load_compose({})["services"]["router"]["environment"]
    assert router_env["PDSERVE_DECODE"] == "dns:///decode:50062"
    assert router_env["PDSERVE_PREFILL"] == "dns:///prefill:50061"

    services = {s["metadata"]["name"]: s for s in by_kind("Service")}
    config = by_kind("ConfigMap")[0]["data"]
    for role, target in (("prefill", config["PDSERVE_PREFILL"]),
                         ("decode", config["PDSERVE_DECODE"])):
        name, port = target.removeprefix("dns:///").split(":")
        service = services[name]
        assert service["spec"]["clusterIP"] == "None", f"{name} must be headless"
        assert service["spec"]["selector"]["app.kubernetes.io/component"] == role
        assert [p["port"] for p in service["spec"]["ports"]] == [int(port)]


def test_every_kubernetes_container_drains_and_declares_resources():
    deployments = {d["metadata"]["name"]: d for d in by_kind("Deployment")}
    drain_s = float(by_kind("ConfigMap")[0]["data"]["PDSERVE_DRAIN_TIMEOUT_S"])
    assert set(deployments) == {"pdserve-router", "pdserve-prefill", "pdserve-decode"}
    for component, container in containers():
        pod = deployments[f"pdserve-{component}"]["spec"]["template"]["spec"]
        assert {"cpu", "memory"} <= set(container["resources"]["requests"]), component
        assert "memory" in container["resources"]["limits"], component
        pre_stop_s = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
        # Kubernetes sends SIGKILL at the end of the grace period, counted from preStop.
        assert pod["terminationGracePeriodSeconds"] > pre_stop_s + drain_s, component
        assert container["args"] == [component]
        assert {"configMapRef": {"name": "pdserve"}} in container["envFrom"]


def test_compose_stop_grace_period_covers_the_drain():
    for name, spec in nodes(load_compose({})).items():
        grace_s = int(spec["stop_grace_period"].removesuffix("s"))
        assert grace_s > float(spec["environment"]["PDSERVE_DRAIN_TIMEOUT_S"]), name


def test_compose_image_is_a_parameter():
    for name, spec in nodes(load_compose({})).items():
        assert spec["image"] == "pdserve:latest", name
    pushed = load_compose({"PDSERVE_IMAGE": "registry.example.com/pdserve:v1"})
    assert {spec["image"] for spec in nodes(pushed).values()} == {"registry.example.com/pdserve:v1"}

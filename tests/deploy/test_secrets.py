"""The keys in the deployment files: every node of compose and of Kubernetes reads the
cluster key from a secret mounted as a file, the router alone also the API key, and no key
is written in the files themselves. Run as local processes, the compose services refuse a
client without the API key and a Worker caller without the cluster token, while their
health checks still pass without any key."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.client import AsyncClient
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.runtime.bearer import bearer_metadata
from pdserve.runtime.cluster_key import ClusterKey
from tests.deploy.compose_local import load_compose, nodes
from tests.deploy.manifests import by_kind, containers

NEEDS = {"router": {"cluster_key", "api_key"}, "prefill": {"cluster_key"},
         "decode": {"cluster_key"}}
K8S_ITEMS = {"router": {"cluster-key", "api-key"}, "prefill": {"cluster-key"},
             "decode": {"cluster-key"}}


def test_every_compose_node_reads_the_cluster_key_and_only_the_router_the_api_key():
    compose = load_compose({})
    assert set(compose["secrets"]) == {"cluster_key", "api_key"}
    assert all(set(s) == {"file"} for s in compose["secrets"].values()), "keys come from files"
    for name, spec in nodes(compose).items():
        assert set(spec["secrets"]) == NEEDS[name], name
        env = spec["environment"]
        assert env["PDSERVE_CLUSTER_KEY_FILE"] == "/run/secrets/cluster_key", name
        assert env.get("PDSERVE_API_KEY_FILE") == \
            ("/run/secrets/api_key" if name == "router" else None), name
        assert not {"PDSERVE_CLUSTER_KEY", "PDSERVE_API_KEY"} & set(env), f"{name}: a key inline"
    own = load_compose({"CLUSTER_KEY_FILE": "/keys/c", "API_KEY_FILE": "/keys/a"})["secrets"]
    assert own == {"cluster_key": {"file": "/keys/c"}, "api_key": {"file": "/keys/a"}}


def test_every_kubernetes_pod_mounts_its_keys_from_the_secret_where_the_configmap_points():
    config = by_kind("ConfigMap")[0]["data"]
    deployments = {d["metadata"]["labels"]["app.kubernetes.io/component"]: d
                   for d in by_kind("Deployment")}
    assert not by_kind("Secret"), "keys are made by the operator, never committed"
    for component, container in containers():
        pod = deployments[component]["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if "secret" in v]
        assert volume["secret"]["secretName"] == "pdserve-keys"
        items = {i["key"]: i["path"] for i in volume["secret"]["items"]}
        assert set(items) == K8S_ITEMS[component], component
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
        assert mount["readOnly"], component
        wanted = {"cluster-key": "PDSERVE_CLUSTER_KEY_FILE", "api-key": "PDSERVE_API_KEY_FILE"}
        for key, path in items.items():
            assert config[wanted[key]] == f"{mount['mountPath']}/{path}", component


def test_compose_nodes_refuse_callers_without_the_keys_and_answer_those_with_them(compose, keys):
    cluster = ClusterKey(keys["cluster"].encode())
    for name, service in compose.services.items():
        assert service.env["PDSERVE_CLUSTER_KEY_FILE"] == keys["CLUSTER_KEY_FILE"], name
        assert service.healthcheck().returncode == 0, f"{name}: health needs no key"

    async def get_load(address, metadata=None):
        async with grpc.aio.insecure_channel(address) as ch:
            return await pdserve_pb2_grpc.WorkerStub(ch).GetLoad(
                pdserve_pb2.LoadRequest(), metadata=metadata, timeout=30)

    async def go():
        async with AsyncClient(compose.services["router"].address, api_key="") as client:
            with pytest.raises(grpc.aio.AioRpcError) as anonymous:
                await client.models()
        refused, loads = [], []
        for name in ("prefill", "decode"):
            address = compose.services[name].address
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await get_load(address)
            refused.append(err.value.code())
            loads.append(await get_load(address, bearer_metadata(cluster.token("router"))))
        return anonymous.value.code(), refused, loads

    anonymous, refused, loads = asyncio.run(go())
    assert anonymous == grpc.StatusCode.UNAUTHENTICATED
    assert refused == [grpc.StatusCode.UNAUTHENTICATED] * 2
    assert [r.role for r in loads] == ["prefill", "decode"]

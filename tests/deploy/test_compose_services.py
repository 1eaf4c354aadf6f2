"""deploy/docker-compose.yml, run as local processes wired like the containers: every
service starts from its own command and environment, passes its own health check, serves
the model the image converted at build time without downloading anything, and a request
through the published router port streams an answer made by prefill and decode."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import urllib.request
from pathlib import Path

from pdserve.models.catalogue import DEFAULT_MODEL
from pdserve.client import AsyncClient
from tests.deploy.compose_local import (PDSERVE, REPO, LocalCompose, image_environment, nodes,
                                        served_ports)
from tests.deploy.conftest import VARIABLES


def test_every_service_starts_from_its_command_and_environment_and_turns_healthy(compose):
    assert set(compose.services) == set(nodes(compose.compose))
    assert set(compose.compose["services"]) - set(compose.services) == {"prometheus"}
    for name, service in compose.services.items():
        result = service.healthcheck()
        assert result.returncode == 0, f"{name}: {result.stdout}{result.stderr}"
        assert "SERVING" in result.stdout


def test_router_streams_an_answer_through_dns_discovered_prefill_and_decode(compose, keys):
    router = compose.services["router"]
    container_ports = [int(p.rsplit(":", 1)[-1]) for p in router.spec["ports"]]
    assert compose.ports["router"][0] in container_ports, "publish the gRPC port the router serves"

    async def ask():
        async with AsyncClient(router.address, api_key=keys["api"]) as client:
            return [msg async for msg in client.responses("the quick brown fox", max_tokens=8,
                                                       temperature=0.0, ignore_eos=True,
                                                       timeout=60)]

    messages = asyncio.run(ask())
    tokens = [t for m in messages for t in m.token_ids]
    assert len(tokens) == 8
    assert len(messages) >= 2, "the answer should stream, not arrive in one message"
    assert [m.finish_reason for m in messages if m.finish_reason] == ["length"]
    final = messages[-1]
    assert final.HasField("usage"), "the stream ends with the usage message"
    route = final.usage.route
    assert route.prefill_endpoint == compose.services["prefill"].address
    assert route.decode_endpoint == compose.services["decode"].address
    assert not route.remote_send_skipped


def get(url: str, api_key: str | None = None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def declared_ports(spec: dict) -> set[int]:
    """The container ports a service publishes (`ports`) or exposes (`expose`)."""
    published = {int(str(p).rsplit(":", 1)[-1]) for p in spec.get("ports", [])}
    return published | {int(p) for p in spec.get("expose", [])}


def test_every_declared_port_is_served_and_answers(compose, keys):
    """The router's OpenAI port answers /v1/models (with the API key) and /metrics; each
    worker's metrics port answers /metrics, and its kernels are the image's, built at build
    time: no service here has a compiler."""
    for name, spec in nodes(compose.compose).items():
        served = served_ports(spec)
        assert declared_ports(spec) == set(served.values()), f"{name} declares what it serves"
        wanted = {"PDSERVE_HTTP_PORT"} if name == "router" else {"PDSERVE_METRICS_PORT"}
        assert wanted <= set(served), f"{name} serves no {wanted}"
        for variable in served:
            url = f"http://{compose.local_address(name, variable)}"
            if variable == "PDSERVE_PORT":
                continue  # gRPC: its health check, above
            status, body = get(f"{url}/metrics")
            assert status == 200 and f'pdserve_node_info{{model="{DEFAULT_MODEL}",role="{name}"}}' \
                in body, f"{name} {variable}: {status} {body[:300]}"
            if variable == "PDSERVE_HTTP_PORT":
                assert get(f"{url}/v1/models")[0] == 401, "the OpenAI API asks for the key"
                status, body = get(f"{url}/v1/models", keys["api"])
                assert status == 200 and json.loads(body)["data"][0]["id"] == DEFAULT_MODEL
            else:
                assert 'pdserve_c_kernels{reason="",state="c"} 1.0' in body, \
                    f"{name} took the torch path: " + compose.services[name].log_path.read_text()[-2000:]


def test_every_service_serves_the_default_model_from_the_image_cache(compose, image_cache, keys):
    for name, service in compose.services.items():
        assert service.env["PDSERVE_MODEL"] == DEFAULT_MODEL, name
        assert service.env["PDSERVE_CACHE"] == image_cache, f"{name} must read the image's cache"

    async def model_info():
        async with AsyncClient(compose.services["router"].address, api_key=keys["api"]) as client:
            return (await client.models())[0]

    assert asyncio.run(model_info()).id == DEFAULT_MODEL
    # Nothing was converted, locked or written at start: the cache is as the build left it.
    assert os.listdir(Path(image_cache, "models")) == [DEFAULT_MODEL]


def test_a_service_without_the_model_in_the_image_fails_instead_of_downloading(tmp_path):
    empty = {image_environment()["PDSERVE_CACHE"]: str(tmp_path / "empty-cache")}
    stack = LocalCompose(VARIABLES, tmp_path, empty)
    command = [str(word) for word in stack.compose["services"]["prefill"]["command"]]
    result = subprocess.run([*PDSERVE, *command], cwd=REPO, env=stack.environment("prefill"),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "could not download" in result.stderr


def test_model_dir_is_mounted_read_only_at_its_own_path_and_served(tiny_model, tmp_path,
                                                                    monkeypatch):
    from pdserve.cli import build_parser
    from pdserve.models_cli import resolve_model

    stack = LocalCompose({**VARIABLES, "MODEL_DIR": tiny_model}, tmp_path)
    for name, spec in nodes(stack.compose).items():
        assert spec["volumes"] == [f"{tiny_model}:{tiny_model}:ro"], name
        env = stack.environment(name)
        assert env["PDSERVE_MODEL"] == tiny_model, name
        # The service's command line, read as the container's `pdserve` reads it.
        for key in (k for k in env if k.startswith("PDSERVE_")):
            monkeypatch.setenv(key, env[key])
        args = build_parser().parse_args([str(word) for word in spec["command"]])
        assert resolve_model(args.model) == tiny_model, name
